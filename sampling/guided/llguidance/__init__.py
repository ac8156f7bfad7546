"""llguidance, the second grammar backend: ``backend`` compiles (the grammar stage's half), ``matcher``
matches with xgrammar's interface (the engine's half, which imports none of the compiler: ``make check``),
``schema`` closes a JSON schema where xgrammar's strict mode closes it, ``tags`` writes xgrammar's
structural tags as Lark grammars."""
