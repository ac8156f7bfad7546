"""The grammar side of an engine step: matchers built, bitmask rows filled on the fill thread beside
the forward, and a compile still running waited for there, never by the step.

A sequence whose request entered the engine before its grammar compiled (its grammar a ``Future``,
pipeline/core/grammar_overlap.py) prefills its whole prompt beside the compile. The fill thread waits
for that compile while the forward runs, and ``_COMPILE_GRACE_S`` after it at most: a compile of
milliseconds (llguidance's, about as long as a short prompt's forward) then costs nothing, and the
sequence samples in the same step. One still running by then samples later: the step leaves its last
prompt token uncomputed, and the scheduler holds that token's chunk until the compile ends
(``Sequence.held_for_grammar``), so a compile of seconds (xgrammar's, where llguidance refused the
spec) never stalls the running decodes.

Only the grammar backends' fill runs on the fill thread, no torch op (sampling/step.py says why).
"""

from __future__ import annotations

import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from sampling.guided.decoder import GuidedDecoder, new_matcher, resolve_grammar
from sampling.masked_sampler import is_lazy
from sampling.sequence import SeqState, Sequence
from sampling.timeline import StepTiming

__all__ = ["StepGrammar"]

# A step that samples a sequence whose grammar still compiles waits this long past its forward at
# most: a compile ending then saves the second forward of the sequence's last prompt token
_COMPILE_GRACE_S = 0.001


class StepGrammar:
    """The fill thread and the matchers of one engine's steps, over its guided decoder."""

    def __init__(self, guided: GuidedDecoder) -> None:
        self.guided = guided
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask-fill")

    def start_fill(
        self, seqs: list[Sequence], defer_greedy: bool, timing: StepTiming, forward_done: Future[None]
    ) -> Future[tuple[list[Sequence], list[int]]] | None:
        """Start the fill of the step that samples ``seqs`` on the fill thread (None: none is guided);
        it gives the sequences that sample in this step and their filled rows. ``forward_done`` is set
        by the caller once its forward has run (and whatever happens to it): a compile is waited for
        until then."""
        if any(s.grammar_compiling for s in seqs):
            return self._filler.submit(self._fill_when_compiled, seqs, forward_done, timing)
        if any(self._needs_matcher(s) or self._fills_row(s, defer_greedy) for s in seqs):
            return self._filler.submit(lambda: (seqs, self.fill(seqs, defer_greedy, timing)))
        # nothing to do beside the forward (every guided row lazy, its matcher built): no hand-off, whose
        # wake-up and GIL hand-backs slowed the forward's own Python by about 0.2 ms a step at batch 8
        return None

    @staticmethod
    def _needs_matcher(seq: Sequence) -> bool:
        """Whether ``ensure_matcher`` would build ``seq``'s matcher."""
        return (
            seq.grammar is not None
            and seq.matcher is None
            and seq.grammar_start is not None
            and seq.state is not SeqState.FINISHED
        )

    @staticmethod
    def _fills_row(seq: Sequence, defer_greedy: bool) -> bool:
        """Whether ``fill`` fills ``seq``'s bitmask row (once its matcher is built)."""
        return seq.matcher is not None and not (defer_greedy and is_lazy(seq))

    def fill(self, seqs: list[Sequence], defer_greedy: bool, timing: StepTiming) -> list[int]:
        """On the fill thread: build missing matchers and fill the step's bitmask rows (but those of
        greedy rows when ``defer_greedy``); the rows filled."""
        started = time.perf_counter()
        for s in seqs:
            self.ensure_matcher(s)
        rows = [i for i, s in enumerate(seqs) if self._fills_row(s, defer_greedy)]
        if rows:
            self.guided.fill([seqs[i].matcher for i in rows], rows)
        timing.fill = time.perf_counter() - started
        return rows

    def ensure_matcher(self, seq: Sequence) -> None:
        """A matcher for ``seq`` once its grammar holds, advanced over what it wrote under the grammar
        (after a preemption); none before its trigger token. A sequence whose grammar still compiles
        samples in no step (``_fill_when_compiled``), so the compile has ended here (sampling/guided/decoder.py,
        resolve_grammar, which would wait for it otherwise).

        :raises GrammarUnavailable: its grammar did not compile."""
        if self._needs_matcher(seq):
            seq.grammar = resolve_grammar(seq.grammar)
            seq.matcher = new_matcher(seq.grammar, seq.output_ids[seq.grammar_start :])

    def _fill_when_compiled(
        self, seqs: list[Sequence], forward_done: Future[None], timing: StepTiming
    ) -> tuple[list[Sequence], list[int]]:
        """``fill`` for a step that samples a sequence whose grammar still compiles: the sequences
        whose grammars are ready by the end of the forward (or ``_COMPILE_GRACE_S`` after it), and
        their filled rows."""
        ready = [s for s in seqs if _compiled_by(s, forward_done)]
        return ready, self.fill(ready, False, timing)


def _compiled_by(seq: Sequence, forward_done: Future[None]) -> bool:
    """Whether ``seq``'s grammar (a failed compile too) is ready by the end of the forward, or
    ``_COMPILE_GRACE_S`` after it."""
    compile_ = seq.grammar
    if not isinstance(compile_, Future):
        return True
    futures.wait([compile_, forward_done], return_when=futures.FIRST_COMPLETED)
    if not compile_.done():
        futures.wait([compile_], timeout=_COMPILE_GRACE_S)
    return compile_.done()
