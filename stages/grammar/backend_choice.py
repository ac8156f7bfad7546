"""Which backend serves a spec: the forced one, the dispatch table's, or llguidance standing in for xgrammar.

- The backend comes from the spec's features (``stages.grammar.dispatch``). A JSON schema, JSON
  object, regex or choice meant for xgrammar is served by llguidance instead (a stand-in) at its
  first use, and no xgrammar compile starts then: llguidance compiles in milliseconds, so no request
  waits for an xgrammar compile llguidance can stand in for (measured with ``bench compile``:
  waiting for xgrammar even behind a distinct image's preparation cost more than llguidance's
  masks), and a spec used once never pays xgrammar's compile. Its second use, a cache hit of the
  stand-in, starts xgrammar's compile in the background at the lowest priority (a thread cannot be
  interrupted), holding its slot; its result replaces the stand-in in the cache for the uses after.
  A stand-in served while both xgrammar compile slots were taken is replaced the same way, by the
  first cache hit that finds a slot free. What llguidance refuses to compile (keywords it will not
  enforce), xgrammar compiles at once and serves.
- An EBNF or Lark grammar or a structural tag is parsed first, without a compile slot: a malformed
  one is a 400 at once, never a wait behind busy slots; its xgrammar compile starts at admission,
  llguidance standing in until it lands where it can, and what llguidance cannot compile of these
  (xgrammar's look-ahead, structural-tag formats Lark cannot say) waits for xgrammar.
- Tool-call grammars always wait for xgrammar; without a task group (no background to compile in)
  xgrammar's compile is waited for too.
"""

from __future__ import annotations

from pipeline.errors import GrammarError, UnsupportedSchemaError
from pipeline.outcome import Outcome
from pipeline.types import GrammarSpec
from stages.grammar.backends import XGrammarCompiler
from stages.grammar.compile import BACKGROUND_NICE, parse_on_thread
from stages.grammar.dispatch import LLGUIDANCE_KINDS, PARSED_KINDS, choose_backend, is_lark
from stages.grammar.jobs import GrammarJobs
from stages.grammar.types import FIRST_USE, OUTLASTS, SLOTS_BUSY, CompiledConstraint

__all__ = ["BackendChoice"]


class BackendChoice(GrammarJobs):
    """The backend choice of ``stages.grammar.GrammarStage``, which sets the attributes below."""

    backend: str
    _parser: XGrammarCompiler

    async def _resolve(self, spec: GrammarSpec) -> Outcome[CompiledConstraint]:
        if self.backend == "llguidance" and spec.kind in LLGUIDANCE_KINDS:
            return await self._await("llguidance", "forced by config", spec)
        if self.backend != "auto":
            return await self._await("xgrammar", "forced by config", spec)
        dispatch = choose_backend(spec)
        if dispatch.backend == "llguidance":
            flight = await self._await("llguidance", dispatch.reason, spec)
            if not isinstance(flight.error, UnsupportedSchemaError):
                return flight  # compiled, or refused for a reason xgrammar would not fix (unsatisfiable)
            # llguidance refuses some keywords outright (uniqueItems, dependencies) where xgrammar
            # ignores them: the answer check holds those, so xgrammar's looser grammar serves
            fallback = await self._await("xgrammar", "llguidance could not compile it", spec)
            return fallback if fallback.error is None else flight
        if spec.kind not in LLGUIDANCE_KINDS:
            return await self._await("xgrammar", dispatch.reason, spec)
        is_dialect = spec.kind in PARSED_KINDS  # llguidance compiles only part of xgrammar's dialects
        if is_dialect:
            refusal = await self._parse(spec)
            if refusal is not None and is_lark(spec.value):  # Lark xgrammar cannot read: llguidance's own
                return await self._await("llguidance", "Lark grammar", spec)
            if refusal is not None:
                failed: Outcome[CompiledConstraint] = Outcome()
                failed.fail(refusal)
                return failed
        if spec.field == "tools":
            # a tool call's grammar never gets a stand-in: the two backends lay out one greedy call
            # differently, so the same request would get another call once xgrammar's compile landed
            return await self._await("xgrammar", dispatch.reason, spec)
        if ("xgrammar", spec.key) not in self._flights and self._is_busy():
            return await self._stand_in(spec, SLOTS_BUSY, None, is_dialect)
        if not is_dialect and self._tg is not None:
            # A spec's first use starts no xgrammar compile: llguidance serves it, and its second use
            # (a hit of this stand-in) starts xgrammar's, at the lowest priority, for the third use
            # on. A one-off schema (many are) never pays xgrammar's compile, and the first request's
            # template step and forward do not share 2 cores with a compile it does not use.
            # Without a task group no hit could start that compile: xgrammar's is waited for below.
            return await self._stand_in(spec, FIRST_USE, None, is_dialect)
        # a dialect's compile may be waited for (what llguidance cannot compile of it), and so is one
        # without a task group: at normal priority
        flight = await self._await("xgrammar", dispatch.reason, spec, wait=False)
        if flight.is_done and flight.error is None:
            return flight
        reason = "xgrammar could not compile it" if flight.is_done else OUTLASTS
        return await self._stand_in(spec, reason, flight, is_dialect)

    def _is_busy(self) -> bool:
        return self.limiter.borrowed_tokens >= self.limiter.total_tokens

    async def _stand_in(
        self, spec: GrammarSpec, reason: str, xgrammar: Outcome[CompiledConstraint] | None, is_dialect: bool
    ) -> Outcome[CompiledConstraint]:
        """llguidance's compile of a spec meant for xgrammar; where llguidance fails, ``xgrammar``'s
        outcome (its job, started now if None) decides when llguidance's refusal may not be final."""
        # decided before llguidance answers, so which refusal a client gets never depends on which
        # compile ended first
        xgrammar_failed = xgrammar is not None and xgrammar.is_done
        fallback = await self._await("llguidance", reason, spec)
        if fallback.error is None:
            return fallback
        if xgrammar is not None and xgrammar_failed:
            return xgrammar  # both failed: the default backend's error is the one reported
        # what llguidance cannot translate, or refuses to enforce, xgrammar may still compile
        if is_dialect or isinstance(fallback.error, UnsupportedSchemaError):
            if xgrammar is None:
                return await self._await("xgrammar", "llguidance could not compile it", spec)
            await xgrammar.wait()
            return xgrammar
        return fallback

    async def _parse(self, spec: GrammarSpec) -> GrammarError | None:
        """xgrammar's parse of a grammar or structural tag (no compile slot: milliseconds); the
        error it is refused with, cached as a compile's would be, or None."""
        try:
            await parse_on_thread(self._parser, spec, self.limits, limiter=self.fast_limiter)
        except GrammarError as exc:
            self.stats.errors += 1
            self._cache.store(spec.key, exc)
            return exc
        return None

    def _replace_stand_in(self, spec: GrammarSpec) -> None:
        """Start xgrammar's compile of a spec llguidance stands in for, when a slot is free and none runs."""
        # nobody waits for it (the stand-in serves meanwhile): it yields the CPU to the requests' own
        # work at the lowest priority (its native threads run without the GIL)
        if self._tg is not None and ("xgrammar", spec.key) not in self._flights and not self._is_busy():
            self._flight("xgrammar", "replaces the llguidance stand-in", spec, BACKGROUND_NICE)
