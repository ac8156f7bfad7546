"""Which backend serves a spec: the forced one, the dispatch table's, or llguidance standing in for xgrammar.

- The backend comes from the spec's features (``stages.grammar_dispatch``). A spec meant for
  xgrammar is served by llguidance instead (a stand-in) until xgrammar's compile has landed (or
  when both xgrammar compile slots are taken): llguidance compiles in milliseconds, so cheap specs
  and refusals answer at once while a big schema compiles, and no request waits for an xgrammar
  compile llguidance can stand in for (measured with ``bench compile``: waiting for xgrammar even
  behind a distinct image's preparation cost more than llguidance's masks). The xgrammar compile
  goes on in the background (a thread cannot be interrupted), holding its slot, and its result
  replaces the stand-in in the cache; a stand-in served while the slots were busy is replaced the
  same way by the first cache hit that finds a slot free.
- An EBNF or Lark grammar or a structural tag is parsed first, without a compile slot: a malformed
  one is a 400 at once, never a wait behind busy slots; what llguidance cannot compile of these
  (xgrammar's look-ahead, structural-tag formats Lark cannot say) waits for xgrammar.
"""

from __future__ import annotations

import anyio

from pipeline.errors import GrammarError, UnsupportedSchemaError
from pipeline.outcome import Outcome
from pipeline.types import GrammarSpec
from stages.grammar_backends import XGrammarCompiler
from stages.grammar_compile import BACKGROUND_NICE, parse_in_thread
from stages.grammar_dispatch import LLGUIDANCE_KINDS, PARSED_KINDS, choose_backend, is_lark
from stages.grammar_jobs import GrammarJobs
from stages.grammar_types import OUTLASTS, SLOTS_BUSY, CompiledConstraint

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
        # a compile nobody waits for (llguidance stands in at once) yields the CPU to the request's
        # own work: the lowest priority (its native threads run without the GIL); a dialect's may
        # be waited for (what llguidance cannot compile of it), and so is one without a task group
        nice = 0 if is_dialect or self._tg is None else BACKGROUND_NICE
        flight = await self._await("xgrammar", dispatch.reason, spec, wait=False, nice=nice)
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
            await anyio.to_thread.run_sync(parse_in_thread, self._parser, spec, self.limits, limiter=self.fast_limiter)
        except GrammarError as exc:
            self.stats.errors += 1
            self._cache.store(spec.key, exc)
            return exc
        return None

    def _replace_stand_in(self, spec: GrammarSpec) -> None:
        """Start xgrammar's compile of a spec llguidance stands in for, when a slot is free and none runs."""
        if self._tg is not None and ("xgrammar", spec.key) not in self._flights and not self._is_busy():
            self._flight("xgrammar", "replaces the llguidance stand-in", spec, BACKGROUND_NICE)
