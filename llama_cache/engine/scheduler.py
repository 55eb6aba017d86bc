"""The step loop: one thread owns every ``llama_decode`` of the engine's context (continuous batching).

Each step the :class:`Scheduler`

1. drops cancelled generations (their sequence keeps what it evaluated, idle);
2. admits waiting ones, each into a sequence id: it starts from the longest head of its tokens that a
   live or idle sequence of its namespace holds (``llama_memory_seq_cp``: cells shared, nothing
   evaluated), or from a state of the cache tiers when that reaches further (restored into its
   sequence), and evaluates the rest. A generation whose head is being read right now by another
   (requests sent together on one system prompt) waits for that prefill and copies it, instead of
   reading it too;
3. builds one batch: the next token of every generating sequence first, then the prompts of the
   others, the shortest remaining prompt first, at most ``n_batch`` rows. Prompts that finish in
   this step go whole, up to ``prompt_rows_per_step`` rows in all (several later turns arriving
   together start answering together); then the prompts that cannot finish read chunks, the
   shortest first, except that a prompt passed over for :data:`STALLED_STEPS` steps goes before them
   (none starves behind a stream of shorter ones). While any row of the step samples (a generated
   token, a prompt finishing), those chunks are only as many rows as keep the step within twice a
   decode-only step, measured (:class:`~.step_budget.StepBudget`), and at least its floor: a
   generating sequence's next token, or a later turn's first one, waits for one bounded chunk of
   another request's long prompt, however long that prompt and however full the pool (prompts that
   finish are not bounded so: a burst of short requests costs the streams one longer step, up to
   the cap). Right after an answer ends, whether rows sample or not, a step's prompt rows start
   again from the floor and double each step back to the cap (prompts that finish still go whole,
   those that cannot still read the floor), until nothing runs: its conversation's next request
   often follows within milliseconds (an agent's next call, a client going on at once), and it
   waits for a short step instead of a full chunk of someone else's prompt. Logits only for the
   rows that sample;
4. decodes it and samples each sequence's token from its row (:class:`~.sampling.Sampler`); the
   generation's ``on_token`` says whether it ends there.

Deterministic mode (``deterministic``, over a context with a KV stream per sequence): each
generation's rows are decoded on their own, in decodes of 2 to :data:`DETERMINISTIC_ROWS` rows (a
lone row gets a throwaway second one at the next position, cut right after). llama.cpp's CPU
attention then always takes its one path that visits a sequence's cells in order and skips other
cells exactly (one query row takes a path split by the cells in view, 64 rows or more a tiled one),
and with its cells in position order in its own stream, a sequence's logits depend only on its own
tokens: a greedy answer is the same alone or under any load, at the cost of batching.

Memory: the pool's cells are counted exactly (:meth:`~.residency.Residency.cells_in_use`). When a step
needs more than are free, idle sequences are evicted, least recently used first, their state given to
the cache tiers first (``store``); if that is not enough, the youngest running generation is
preempted: its cells are dropped and it waits, first in line, to evaluate its tokens again (a greedy
answer is unchanged). A decode never fails for want of cells.

Idle sequences also leave for the cache tiers (but those a waiting generation goes on from, and
those whose state the tiers refused) when a generation is admitted with at least
``clear_idle_rows`` prompt tokens to read and nothing else running (as ``llama-server
--cache-idle-slots`` does on each new task): in one pool every row a step evaluates walks the cells
up to the highest in use, idle conversations' included, so a long prompt read beside them costs more
the more they hold (measured with the default model, 2 threads: 800 prompt tokens in 3.2 s with
nothing else in the pool, 4.6 s beside five idle 1,100-token conversations). Storing an idle
conversation and restoring it when it comes back costs about what 90 rows walking its cells cost, so
short prompts (a conversation's next turn) leave them where they are. Reading the states out holds
the step loop (about 25 ms per 1,000 tokens), so it is done only when no other generation would wait
for it: otherwise clients sending long prompts one after another could hold everyone's tokens so.

Thread-safety: :meth:`Scheduler.submit`, :meth:`Scheduler.wake`, :meth:`Scheduler.close` and the
counters may be used from any thread; everything else runs on the scheduler's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from llama_cache.checkpoints import HybridCheckpoint
from llama_cache.engine.context import BatchContext, DecodeFailed, NoCells
from llama_cache.engine.residency import Resident, Residency, common_prefix
from llama_cache.engine.rollback import Rollback
from llama_cache.engine.sampling import Sampler
from llama_cache.engine.step_budget import StepBudget
from llama_cache.state.llama_state import LlamaState

__all__ = ["DETERMINISTIC_ROWS", "MIN_SHARED_TOKENS", "STALLED_STEPS", "Generation", "Scheduler", "SchedulerStats"]

logger = logging.getLogger(__name__)

MIN_SHARED_TOKENS = 32
"""The shortest head of another prefill in flight worth waiting for (chat prompts all share their
template's first few tokens)."""

STALLED_STEPS = 8
"""A prompt passed over this many steps in a row reads its chunk before shorter ones (no starvation)."""

DETERMINISTIC_ROWS = 63
"""The most rows of a decode in deterministic mode: llama.cpp's CPU flash attention tiles 64 query
rows or more (``GGML_FA_TILE_Q``), a path whose sums depend on where a sequence's cells lie."""

TokenCallback = Callable[[int], "str | None"]
"""Told each sampled token on the scheduler's thread; returns a finish reason to end the generation."""


@dataclass(eq=False)
class Generation:
    """One sequence's generation, handed to :meth:`Scheduler.submit`.

    Args:
        prompt: its tokens (at least one; fewer than the pool's cells).
        fingerprint: its cache namespace's fingerprint: only sequences and states of it are reused.
        sampler: samples its tokens (closed by the scheduler when it ends).
        on_token: see :data:`TokenCallback`.
        cancelled: asked every step; True ends it (``finish_reason`` ``"cancelled"``).
        restore: a state of the cache tiers for a head of ``prompt`` (the caller looked it up), used
            if it reaches further than any sequence.
        counted_on: without ``restore``, how many leading tokens of ``prompt`` a sequence of the
            context held when the caller looked in the tiers. If no sequence holds that many when the
            scheduler places it (that sequence was evicted meanwhile, its state given to the tiers),
            the scheduler looks in the tiers again, once, on its thread (``lookup``).
        keep_state: when it ends, its sequence's state is read into :attr:`state` (for the caller to
            store in the cache tiers).

    Results (read them once :attr:`done` is set): ``finish_reason`` (``"stop"``, ``"length"``,
    ``"cancelled"`` or ``"error"``, with ``error``), ``reused`` (prompt tokens not evaluated),
    ``prompt_evaluated``, ``state``.
    """

    prompt: npt.NDArray[np.int32]
    fingerprint: str
    sampler: Sampler
    on_token: TokenCallback
    cancelled: Callable[[], bool] = lambda: False
    restore: LlamaState | None = None
    counted_on: int = 0
    keep_state: bool = False
    reused: int = 0
    restored: int = 0
    prompt_evaluated: int = 0
    finish_reason: str | None = None
    error: BaseException | None = None
    state: LlamaState | None = None
    done: threading.Event = field(default_factory=threading.Event)
    # The scheduler's: what it sampled, what is left to evaluate, where.
    sampled: list[int] = field(default_factory=list)
    todo: npt.NDArray[np.int32] = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    resident: Resident | None = None
    generating: bool = False
    stored_row: npt.NDArray[np.float32] | None = None  # an exact repeat's logits row, to sample from
    admitted: bool = False
    order: int = 0
    stalled: int = 0  # steps its prompt, unable to finish in one, was passed over

    def tokens(self) -> npt.NDArray[np.int32]:
        """Every token its sequence should hold: the prompt and the tokens sampled (the last one not
        evaluated yet while it generates)."""
        if not self.sampled:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.sampled, dtype=np.int32)])


@dataclass
class SchedulerStats:
    """Counters since the scheduler started (read from any thread)."""

    steps: int = 0
    tokens: int = 0
    """Tokens evaluated (prompt rows and generated tokens' rows)."""
    decode_seconds: float = 0.0
    """Time in ``llama_decode`` alone."""
    step_seconds: float = 0.0
    """Whole steps, decode included: ``step_seconds - decode_seconds`` is the Python around it
    (admission, filling the batch, sampling, text and streaming)."""
    evicted: int = 0
    preempted: int = 0
    shared_tokens: int = 0
    """Tokens a sequence took from another's cells instead of evaluating them."""
    restored_tokens: int = 0
    rolled_back_tokens: int = 0
    """Tokens a sequence of a recurrent model kept by going back to a checkpoint instead of evaluating them."""


class Scheduler:
    """The step loop (see the module's docstring) on a thread of its own, started at once.

    Args:
        context: the context it owns from now on.
        residency: its sequences.
        store: gives an evicted sequence's state to the cache tiers, returning whether they took it
            (never raises); None: evictions drop their state.
        lookup: the cache tiers' state for the longest head of some tokens in a namespace, or None
            (never raises): asked for a generation whose head was evicted after its caller looked
            (see :attr:`Generation.counted_on`).
        max_running: generations running at once (the others wait); at most the sequence ids.
        prompt_rows_per_step: the most prompt rows a step carries, a prompt that cannot finish in it
            fewer while other rows sample and right after an answer ends (see
            :class:`~.step_budget.StepBudget`).
        deterministic: each generation's rows in decodes of their own (see the module's docstring);
            the context must give each sequence a stream of its own, with a cell to spare beyond
            what any generation holds.
        clear_idle_rows: a generation admitted with at least this many prompt tokens to read, and
            nothing else running, first moves every idle sequence to the cache tiers (see the
            module's docstring); None: never.
            Only with ``store``, and only where sequences share one pool.
        rollback: a recurrent or hybrid model's checkpoints per sequence (owned by the caller, who
            closes it after this scheduler): prompts are read up to each checkpoint and saved there,
            and a prompt leaving an idle sequence's path takes it back to the furthest checkpoint on
            its own.
    """

    def __init__(self, context: BatchContext, residency: Residency, *,
                 store: Callable[[LlamaState], bool] | None = None,
                 lookup: Callable[[npt.NDArray[np.int32], str], LlamaState | None] | None = None,
                 max_running: int | None = None,
                 prompt_rows_per_step: int = 64, deterministic: bool = False,
                 rollback: Rollback | None = None, clear_idle_rows: int | None = None) -> None:
        if deterministic and context.shares_cells:
            raise ValueError("deterministic mode needs a KV stream per sequence (kv_unified off)")
        if clear_idle_rows is not None and (clear_idle_rows < 1 or store is None or not context.shares_cells):
            raise ValueError("clear_idle_rows must be positive, with a store, over one shared pool")
        self.context = context
        self.residency = residency
        self._store = store
        self._lookup = lookup
        n_seq = len(residency.residents)
        self.max_running = min(max_running or n_seq, n_seq)
        self.step_budget = StepBudget(max(1, min(prompt_rows_per_step, context.n_batch)))
        self.deterministic = deterministic
        self.rollback = rollback
        self.clear_idle_rows = clear_idle_rows
        self.stats = SchedulerStats()
        self._condition = threading.Condition()
        self._inbox: list[Generation] = []
        self._waiting: deque[Generation] = deque()
        self._running: list[Generation] = []
        self._orders = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="llama-cache-engine", daemon=True)
        self._thread.start()

    # -- any thread ----------------------------------------------------------------------------

    def submit(self, generation: Generation) -> None:
        """Queue ``generation``; its ``done`` event is set when it ends.

        Raises:
            RuntimeError: the scheduler is closed.
            ValueError: its prompt is empty or does not fit the pool.
        """
        limit = self.context.n_ctx_seq - (1 if self.deterministic else 0)
        if not 0 < len(generation.prompt) < limit:
            raise ValueError(f"a prompt takes 1 to {limit - 1} tokens, got {len(generation.prompt)}")
        with self._condition:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._inbox.append(generation)
            self._condition.notify()

    def wake(self) -> None:
        """Have the loop look at its generations now (a caller cancelled one)."""
        with self._condition:
            self._condition.notify()

    @property
    def running(self) -> int:
        """Generations admitted into a sequence."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Generations submitted and not admitted yet."""
        with self._condition:
            return len(self._inbox) + len(self._waiting)

    def on_thread(self) -> bool:
        """Whether the caller is the scheduler's thread."""
        return threading.current_thread() is self._thread

    def close(self) -> None:
        """Stop the loop (generations not done end ``"cancelled"``) and wait for it; once."""
        with self._condition:
            if self._closed:
                return
            self._closed = True
            self._condition.notify()
        self._thread.join()

    # -- the loop --------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._closed and not self._inbox and not self._running and not self._waiting:
                    self._condition.wait()
                if self._closed:
                    break
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            try:
                worked = self._step()
            except Exception:  # noqa: BLE001 - the loop must outlive any one step's failure
                logger.exception("an engine step failed; ending the generations it held")
                for generation in list(self._running):
                    self._finish(generation, "error", RuntimeError("the engine failed"))
                worked = True
            if not worked:
                with self._condition:  # only waiters that cannot be admitted yet: look again soon
                    self._condition.wait(timeout=0.02)
        for generation in [*self._running, *self._waiting, *self._inbox]:
            self._finish(generation, "cancelled")

    def _step(self) -> bool:
        started = time.perf_counter()
        self._drop_cancelled()
        self._admit()
        for generation in [g for g in self._running if g.stored_row is not None]:
            row, generation.stored_row = generation.stored_row, None
            resident = generation.resident
            assert resident is not None
            self._sample(generation, lambda g=generation, r=resident, x=row: g.sampler.sample_row(x, r.tokens))
        if not self._running:
            self.step_budget.idle()
            return False
        ramp = self.step_budget.take_ramp()
        for _ in range(8):
            plan = self._plan(ramp)
            if not plan:
                return False
            rows = plan[-1][1] + plan[-1][2]
            try:
                self._decode(plan)
            except NoCells:
                logger.debug("no cells for a %d-row batch; evicting", rows)
                if not self._evict_one() and not self._preempt_youngest():
                    break
                continue
            except DecodeFailed as error:
                logger.error("%s; ending the generations of the batch", error)
                for generation, _, _ in plan:
                    resident = generation.resident
                    if resident is not None:
                        # llama.cpp may have kept some of the batch's rows: what the sequence holds is unknown.
                        self.context.cut(resident.seq)
                        self.residency.emptied(resident)
                    if generation in self._running:
                        self._finish(generation, "error", error)
                return True
            self.stats.steps += 1
            self.stats.step_seconds += time.perf_counter() - started
            if not self._running:
                self.step_budget.idle()
            return True
        for generation in list(self._running):
            self._finish(generation, "error", RuntimeError("the context has no room for this batch"))
        return True

    # -- admission -------------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        for generation in [g for g in self._waiting if _cancelled(g)]:
            self._waiting.remove(generation)
            self._finish(generation, "cancelled")
        for generation in [g for g in self._running if _cancelled(g)]:
            self._finish(generation, "cancelled")

    def _admit(self) -> None:
        for generation in list(self._waiting):
            if len(self._running) >= self.max_running:
                return
            if self._place(generation):
                self._waiting.remove(generation)
                if not generation.admitted:
                    generation.admitted = True
                    self._orders += 1
                    generation.order = self._orders
                self._running.append(generation)
                self._running.sort(key=lambda g: g.order)
                if (self.clear_idle_rows is not None and len(generation.todo) >= self.clear_idle_rows
                        and len(self._running) == 1):
                    self._clear_idle()

    def _clear_idle(self) -> None:
        """Move the idle sequences to the cache tiers (see the module's docstring), but those a
        waiting generation would go on from, and those whose state could not be stored."""
        wanted = set()
        for waiting in self._waiting:
            tokens = waiting.tokens()
            source, _ = self.residency.reusable(tokens, waiting.fingerprint, len(tokens) - 1)
            wanted.add(id(source))
        for resident in self.residency.idle():
            if id(resident) not in wanted and self._store_resident(resident):
                self._evict(resident)

    def _place(self, generation: Generation) -> bool:
        """Give ``generation`` a sequence holding the longest reusable head of its tokens; False: not now."""
        residency = self.residency
        tokens = generation.tokens()
        limit = len(tokens) - 1  # the last token is evaluated: its row is sampled
        fingerprint = generation.fingerprint
        if not generation.sampled and self._place_exact(generation, tokens):
            return True
        source, reused = residency.reusable(tokens, fingerprint, limit)
        if generation.restore is None and generation.counted_on > reused and self._lookup is not None:
            generation.counted_on = 0  # one look: the head it counted on went to the tiers
            try:
                generation.restore = self._lookup(tokens, fingerprint)
            except Exception as error:  # noqa: BLE001 - a failing lookup is a miss
                logger.warning("prompt cache lookup failed: %s: %s", type(error).__name__, error)
        if not residency.whole_states_only and self._head_in_flight(tokens[:limit], fingerprint, reused):
            return False
        restore, usable = generation.restore, 0
        if restore is not None:
            usable = self._usable(restore, generation, tokens, limit)
            if usable <= reused:
                restore, generation.restore = None, None
        rolled = self._rolled_back_for(tokens[:limit], fingerprint, max(reused, usable))
        if rolled is not None:
            target, reused = rolled
            generation.restore = None
        elif restore is None and source is not None and not source.busy and source.n == reused:
            target = source  # a conversation's next turn: its sequence goes on
        else:
            target = residency.free() or self._evict_one(keep=source)
            if target is None and restore is None and source is not None and not source.busy:
                # The only sequence to be had holds this head: it goes on from there, its tail stored.
                self._store_resident(source)
                target = source
            if target is None:
                return False
            if target is source:
                pass
            elif restore is not None and self._restore(target, restore, usable, tokens):
                reused = usable
                generation.restored = usable
            elif source is not None and reused > 0 and self.context.copy_cells(source.seq, target.seq, reused):
                residency.copied(source, target, reused)
                self.stats.shared_tokens += reused
            else:
                reused = 0
            generation.restore = None
        residency.claim(target, fingerprint)
        if target.n > reused and not self._cut(target, reused):
            reused = 0
        generation.resident = target
        if generation.sampled == [] and not generation.generating:
            generation.reused = reused
        generation.todo = tokens[reused:]
        generation.generating = False
        return True

    def _rolled_back_for(self, head: npt.NDArray[np.int32], fingerprint: str,
                         beyond: int) -> tuple[Resident, int] | None:
        """Take the idle sequence of the namespace whose checkpoint holds the longest part of ``head``,
        if longer than ``beyond``, back to that checkpoint: it and the tokens it holds now; None if
        there is none. Its history is kept first: copied into a free sequence if there is one (cells
        shared, nothing evaluated), else given to the tiers, as at an eviction."""
        if self.rollback is None:
            return None
        best: tuple[Resident, HybridCheckpoint] | None = None
        for resident in self.residency.idle():
            if resident.fingerprint != fingerprint:
                continue
            checkpoint = self.rollback.best(resident.seq, head)
            if checkpoint is None or checkpoint.pos <= max(beyond, 0 if best is None else best[1].pos):
                continue
            if common_prefix(resident.tokens, head) >= checkpoint.pos:
                best = (resident, checkpoint)
        if best is None:
            return None
        resident, checkpoint = best
        pos = checkpoint.pos
        spare = self.residency.free()
        if spare is not None and self.context.copy_cells(resident.seq, spare.seq, resident.n):
            self.residency.copied(resident, spare, resident.n)
            self.residency.release(spare)  # idle, as recently used as the history it holds
        else:
            self._store_resident(resident)
        if not self.rollback.restore(resident.seq, checkpoint):
            logger.info("a checkpoint could not be restored; evaluating")
            self.context.cut(resident.seq)
            self.residency.emptied(resident)
            return None
        self.residency.rolled_back(resident, pos)
        self.stats.rolled_back_tokens += pos
        return resident, pos

    def _place_exact(self, generation: Generation, tokens: npt.NDArray[np.int32]) -> bool:
        """An exact repeat of a prompt a sequence holds with its logits row: it shares all the cells
        and samples from that row, evaluating nothing. False: not one (or no sequence id now)."""
        residency = self.residency
        source, reused = residency.reusable(tokens, generation.fingerprint, len(tokens))
        if source is None or reused != len(tokens) or source.logits is None or source.logits[0] != reused:
            return False
        row = source.logits[1]
        if not source.busy and source.n == reused:
            target: Resident | None = source
        else:
            target = residency.free() or self._evict_one(keep=source)
            if target is None or not self.context.copy_cells(source.seq, target.seq, reused):
                return False
            residency.copied(source, target, reused)
            self.stats.shared_tokens += reused
        residency.claim(target, generation.fingerprint)
        generation.resident = target
        generation.reused = reused
        generation.todo = tokens[:0]
        generation.generating = False
        generation.stored_row = row
        return True

    def _head_in_flight(self, tokens: npt.NDArray[np.int32], fingerprint: str, reused: int) -> bool:
        """Whether a running prefill of the namespace is reading a head of ``tokens`` at least
        :data:`MIN_SHARED_TOKENS` longer than ``reused``, not read yet."""
        for other in self._running:
            if other.generating or other.fingerprint != fingerprint or other.resident is None:
                continue
            shared = common_prefix(other.tokens(), tokens)
            if shared >= reused + MIN_SHARED_TOKENS and other.resident.n < shared:
                return True
        return False

    def _usable(self, state: LlamaState, generation: Generation, tokens: npt.NDArray[np.int32], limit: int) -> int:
        """How many leading tokens of ``tokens`` (at most ``limit``) restoring ``state`` gives."""
        if state.fingerprint != generation.fingerprint:
            return 0
        shared = common_prefix(np.asarray(state.tokens, dtype=np.int32), tokens[:limit])
        if self.residency.whole_states_only:
            return state.n_tokens if shared >= state.n_tokens else 0
        return shared

    def _restore(self, target: Resident, state: LlamaState, usable: int, tokens: npt.NDArray[np.int32]) -> bool:
        """Restore ``state``'s first ``usable`` tokens into ``target`` (empty). False: refused (logged)."""
        if usable < state.n_tokens:
            state = state.prefix(usable, None)
        if self.context.n_ctx - self.residency.cells_in_use() < state.n_tokens and not self._make_room(state.n_tokens):
            return False
        try:
            with state.restore_source(target.seq) as (data, held):
                if not self.context.write_sequence(target.seq, data):
                    logger.info("a %d-token state could not be restored (no contiguous cells); evaluating",
                                state.n_tokens)
                    return False
        except (ValueError, TypeError) as error:
            logger.warning("cache miss: unusable state (%s)", error)
            self.context.cut(target.seq)
            return False
        n = state.n_tokens
        if held > n and not self.context.cut(target.seq, n):
            self.context.cut(target.seq)
            return False
        self.residency.restored(target, tokens[:n], stored=True)
        self.stats.restored_tokens += n
        return True

    # -- memory ----------------------------------------------------------------------------------

    def _free_cells(self) -> int:
        return self.context.n_ctx - self.residency.cells_in_use()

    def _make_room(self, cells: int) -> bool:
        while self._free_cells() < cells:
            if self._evict_one() is None:
                return False
        return True

    def _cut(self, resident: Resident, n_tokens: int) -> bool:
        if self.context.cut(resident.seq, n_tokens):
            self.residency.cut(resident, n_tokens)
            return True
        self.context.cut(resident.seq)  # recurrent memory cut inside its history: start over
        self.residency.emptied(resident)
        return False

    def _evict_one(self, keep: Resident | None = None) -> Resident | None:
        """Empty the least recently used idle sequence (its state stored first); None if none is idle."""
        for resident in self.residency.idle():
            if resident is not keep:
                self._evict(resident)
                return resident
        return None

    def _evict(self, resident: Resident) -> None:
        """Empty idle ``resident``, its state given to the cache tiers first."""
        self._store_resident(resident)
        self.context.cut(resident.seq)
        self.residency.emptied(resident)
        self.stats.evicted += 1

    def _store_resident(self, resident: Resident) -> bool:
        """Give ``resident``'s state to the tiers unless they hold it; whether they do now."""
        if self._store is None:
            return False
        if resident.n == 0 or resident.stored >= resident.n:
            return True
        try:
            return self._store(self.snapshot(resident))
        except Exception as error:  # noqa: BLE001 - storing is an optimisation
            logger.warning("could not store an evicted sequence's state: %s: %s", type(error).__name__, error)
            return False

    def snapshot(self, resident: Resident) -> LlamaState:
        """``resident``'s tokens and llama.cpp state as a :class:`LlamaState` (its namespace's); marks
        them stored. On the scheduler's thread, or after it stopped."""
        raw = self.context.read_sequence(resident.seq)
        tokens = resident.tokens.copy()
        tokens.setflags(write=False)
        state = LlamaState.from_seq_bytes(tokens, None, 0, resident.fingerprint, raw,
                                          parse=not self.residency.whole_states_only)
        resident.stored = resident.n
        return state

    def _preempt_youngest(self) -> bool:
        """Drop the cells of the youngest running generation (unless it is the only one); it waits first in line."""
        if len(self._running) < 2:
            return False
        generation = self._running.pop()
        resident = generation.resident
        if resident is not None:
            self.context.cut(resident.seq)
            self.residency.emptied(resident)
            self.residency.release(resident)
        generation.resident = None
        generation.generating = False
        self._waiting.appendleft(generation)
        self.stats.preempted += 1
        logger.info("the context is full: a generation waits to evaluate its %d tokens again",
                    len(generation.tokens()))
        return True

    # -- the batch -------------------------------------------------------------------------------

    def _plan(self, ramp: int) -> list[tuple[Generation, int, int]]:
        """Fill the batch: ``(generation, first row, rows)`` in row order (see the module's docstring);
        at most ``ramp`` prompt rows but for prompts that finish and the floor."""
        context = self.context
        decoding = [g for g in self._running if g.generating]
        while self._free_cells() < len(decoding):
            if self._evict_one() is None and not self._preempt_youngest():
                break
            decoding = [g for g in self._running if g.generating]
        plan: list[tuple[Generation, int, int]] = []
        rows = 0
        for generation in decoding[: context.n_batch]:
            plan.append((generation, rows, 1))
            rows += 1
        room = context.n_batch - rows
        budget = self.step_budget
        chunk = DETERMINISTIC_ROWS if self.deterministic else context.n_batch
        # Prompts that finish in this step go whole, the shortest first, up to the cap in all: their rows
        # cost the same read now or spread over steps, and read now, each answer starts a step later
        # instead of a queue of steps later. A prompt stopped short of its end at a recurrent model's
        # checkpoint goes on next step. Then the prompts that cannot finish here read chunks, the
        # shortest first, but prompts passed over for STALLED_STEPS steps before them, the longest
        # passed over (then the oldest) first, so that none waits forever behind a stream of shorter
        # ones: if any row of the step samples (a generated token, a prompt finishing), only what fits
        # the measured time budget, at least the floor; and, just after an answer ended, only what the
        # ramp leaves (StepBudget.answer_ended), at least the floor.
        free = self._free_cells() - rows

        def fitted(generation: Generation, want: int) -> int:
            """``want`` rows of ``generation``'s prompt, fewer to stop at a checkpoint or for want of cells."""
            nonlocal free
            take = want
            if self.rollback is not None and not generation.sampled and generation.resident is not None:
                take = self.rollback.until_next(generation.resident.n, len(generation.prompt), take)
            if take > free:
                self._make_room(rows + take)
                free = self._free_cells() - rows
                take = min(take, free)
            return take

        reading = sorted((g for g in self._running if not g.generating), key=lambda g: len(g.todo))
        going_on: list[Generation] = []
        taken = 0
        sampling = rows
        for generation in reading:
            left = len(generation.todo)
            if left > min(chunk, room - taken, budget.cap - taken):
                going_on.append(generation)
                continue
            take = fitted(generation, left)
            if take <= 0:
                break
            plan.append((generation, rows, take))
            rows += take
            taken += take
            free -= take
            if take == left:
                sampling += 1
        limit = max(min(budget.rows(sampling), ramp) - taken, budget.floor)
        stalled = sorted((g for g in going_on if g.stalled >= STALLED_STEPS), key=lambda g: (-g.stalled, g.order))
        going_on = stalled + [g for g in going_on if g.stalled < STALLED_STEPS]
        for generation in going_on:
            want = min(len(generation.todo), chunk, room - taken, max(limit, 0))
            take = fitted(generation, want) if want > 0 else 0
            if take <= 0:
                break
            plan.append((generation, rows, take))
            rows += take
            taken += take
            free -= take
            limit -= take
        planned = {id(generation) for generation, _, _ in plan}
        for generation in going_on:
            generation.stalled = 0 if id(generation) in planned else generation.stalled + 1
        if not plan and self._running and self._preempt_youngest():
            return self._plan(ramp)
        return plan

    def _decode(self, plan: list[tuple[Generation, int, int]]) -> None:
        """Evaluate the plan's rows and sample where they end: one batch, or in deterministic mode one
        decode per generation (a lone row with a throwaway second one, cut after).

        Raises:
            NoCells, DecodeFailed: as :meth:`~.context.BatchContext.decode` (generations already
                decoded in this call have advanced).
        """
        if not self.deterministic:
            for generation, row, count in plan:
                self._fill(generation, row, count)
            decode_rows = sum(1 for generation, _, _ in plan if generation.generating)
            rows = plan[-1][1] + plan[-1][2]
            self.step_budget.observe(decode_rows, rows - decode_rows, self._timed_decode(rows))
            self._advance(plan)
            return
        context = self.context
        for generation, _, count in plan:
            self._fill(generation, 0, count)
            resident = generation.resident
            assert resident is not None
            rows = count
            if count == 1:
                context.tokens[1] = context.tokens[0]
                context.positions[1] = context.positions[0] + 1
                context.sequences[1] = resident.seq
                context.wants_logits[1] = 0
                rows = 2
            self._timed_decode(rows)
            if rows > count and not context.cut(resident.seq, resident.n + count):
                raise DecodeFailed("a deterministic decode's extra row could not be cut")
            self._advance([(generation, 0, count)])

    def _timed_decode(self, rows: int) -> float:
        """Decode ``rows`` rows; the seconds it took."""
        started = time.perf_counter()
        try:
            self.context.decode(rows)
        finally:
            seconds = time.perf_counter() - started
            self.stats.decode_seconds += seconds
        return seconds

    def _fill(self, generation: Generation, row: int, count: int) -> None:
        context = self.context
        resident = generation.resident
        assert resident is not None
        end = row + count
        context.tokens[row:end] = generation.todo[:count]
        context.positions[row:end] = np.arange(resident.n, resident.n + count, dtype=np.int32)
        context.sequences[row:end] = resident.seq
        context.wants_logits[row:end] = 0
        if count == len(generation.todo):
            context.wants_logits[end - 1] = 1

    def _advance(self, plan: list[tuple[Generation, int, int]]) -> None:
        for generation, row, count in plan:
            resident = generation.resident
            assert resident is not None
            self.residency.appended(resident, generation.todo[:count])
            generation.todo = generation.todo[count:]
            self.stats.tokens += count
            if not generation.sampled:
                generation.prompt_evaluated += count
            if len(generation.todo):
                if (self.rollback is not None and not generation.sampled
                        and self.rollback.due(resident.n, len(generation.prompt))):
                    self.rollback.save(resident.seq, resident.tokens)
                continue
            last = row + count - 1
            if not generation.sampled:  # the prompt's last row: kept for an exact repeat
                self.residency.kept_logits(resident, self.context.logits_row(last).copy())
            self._sample(generation, lambda g=generation, r=resident, i=last: g.sampler.sample(self.context, i, r.tokens))

    def _sample(self, generation: Generation, sample: Callable[[], int]) -> None:
        """Sample ``generation``'s next token; it ends there or evaluates that token next."""
        try:
            token = sample()
            generation.sampled.append(token)
            generation.generating = True
            reason = generation.on_token(token)
        except Exception as error:  # noqa: BLE001 - one generation's failure is its own
            logger.exception("a generation failed while sampling")
            self._finish(generation, "error", error)
            return
        if reason is not None:
            self._finish(generation, reason)
        else:
            generation.todo = np.array([token], dtype=np.int32)

    def _finish(self, generation: Generation, reason: str, error: BaseException | None = None) -> None:
        resident = generation.resident
        if resident is not None:
            if generation.keep_state and reason in ("stop", "length") and resident.n > 0:
                try:
                    generation.state = self.snapshot(resident)
                except Exception as failure:  # noqa: BLE001 - the answer stands without its state
                    logger.warning("could not read a finished sequence's state: %s", failure)
            self.residency.release(resident)
        if generation in self._running:
            self._running.remove(generation)
        generation.sampler.close()
        if reason in ("stop", "length"):
            self.step_budget.answer_ended()
        generation.finish_reason = reason
        generation.error = error
        generation.done.set()


def _cancelled(generation: Generation) -> bool:
    try:
        return bool(generation.cancelled())
    except Exception:  # noqa: BLE001 - a failing check is a cancellation
        return True
