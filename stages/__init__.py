"""The request-preparation stages, one module each: fetch, decode, template, vision_encode; and the
grammar stage, a folder of its own (``stages.grammar``).

A stage is a small object with its own limits and a ``run``/``compile`` coroutine; it knows nothing
about streams or other stages (``pipeline/core/staged.py`` wires them).
"""
