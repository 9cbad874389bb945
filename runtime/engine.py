"""The engine loop: scheduler -> runner -> scheduler update -> detokenize, once per step.

`LLMEngine.step()` is the whole serving loop body; `LLM` (runtime/llm.py) drives it to
completion for offline use and the server drives it from a background task. Start-up (load,
compile, KV cache, CUDA graphs) is runtime/builder.py's: the engine gets a finished scheduler
and model runner.
"""

from __future__ import annotations

import time

from compile_engine.models.loader import LoadedModel
from compile_engine.runtime.builder import Progress, build_engine
from compile_engine.runtime.detokenizer import IncrementalDetokenizer
from compile_engine.runtime.engine_config import TARGETS, EngineConfig, EngineConfigError
from compile_engine.runtime.model_runner import InFlightStep, RunnerOutput
from compile_engine.runtime.outputs import CompletionOutput, RequestOutput
from compile_engine.runtime.prompt_logprobs import PromptScores
from compile_engine.runtime.request import Request, RequestStatus
from compile_engine.runtime.sampling_params import SamplingParams
from compile_engine.runtime.scheduler import SchedulerStats
from compile_engine.runtime.sequence import Group, Sequence
from compile_engine.runtime.spec_policy import SpeculationPolicy
from compile_engine.runtime.speculative import Speculator

__all__ = [
    "TARGETS",
    "CompletionOutput",
    "EngineConfig",
    "EngineConfigError",
    "LLMEngine",
    "RequestOutput",
]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        progress: Progress | None = None,
        *,
        proposer: object | None = None,
    ) -> None:
        """Start an engine for `config` (or around an already `loaded` model): the builder
        loads, compiles and captures (runtime/builder.py), the engine keeps what it built;
        `progress` hears the long phases (runtime/progress.py); `proposer` replaces the
        speculative_config method's (benchmarks only: `build_engine`)."""
        parts = build_engine(config, loaded, progress, proposer=proposer)
        self.config = parts.config
        self.manifest = parts.manifest
        self.loaded = parts.loaded
        self.model_config = parts.loaded.config
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.compiled = parts.compiled
        self.timings = parts.timings
        self.weights_read_s = parts.weights_read_s
        self.activation_profile_cached = parts.activation_profile_cached
        self.structured = parts.structured
        eos = self.model_config.eos_token_ids
        self.eos_token_id = eos[0] if eos else getattr(self.tokenizer, "eos_token_id", None)
        self.groups: dict[str, Group] = {}
        self._seq_of: dict[str, tuple[Group, Sequence]] = {}
        self._counter = 0
        self._in_flight: InFlightStep | None = None
        # A step processed at once whose text and outputs wait for the next launch (`step`).
        self._undelivered: tuple[InFlightStep, RunnerOutput] | None = None
        self._needs_history: set[str] = set()  # live groups whose sampling reads past tokens
        # Speculative decoding's choice of k a step (runtime/spec_policy.py); None: always
        # num_speculative_tokens.
        spec = self.config.speculative_config
        self.spec_policy = (
            SpeculationPolicy(spec.num_speculative_tokens) if spec and spec.adaptive else None
        )
        self._num_drafts: int | None = None  # the next step's k (None: the config's)

    # -- requests -----------------------------------------------------------------------------

    def next_request_id(self) -> str:
        self._counter += 1
        return str(self._counter)

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead")
            try:
                prompt.encode()  # a lone UTF-16 surrogate is a str but not text
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"the prompt is not valid Unicode ({exc.reason} at index {exc.start}); "
                    "pass text without unpaired surrogates"
                ) from None
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return None, [int(t) for t in prompt]

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request (n siblings for n > 1). Raises the scheduler's typed errors
        (RequestTooLong, QueueFull, DuplicateRequest) without queuing anything."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in flight")
        text, token_ids = self.tokenize(prompt)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        now = time.monotonic()
        sequences = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(
                request_id=rid,
                prompt_token_ids=token_ids,
                sampling_params=params,
                eos_token_id=self.eos_token_id,
                arrival_time=now,
                cache_salt=cache_salt,
                group_id=request_id if params.n > 1 else None,
                sibling_index=i,
            )
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
            logprobs = [] if params.logprobs is not None else None
            sequences.append(Sequence(request, detok, logprobs))
        ids = [seq.request.request_id for seq in sequences]
        if params.structured_outputs is not None:  # raises GrammarError, before anything queues
            tail = self.tokenizer.decode(token_ids[-32:]) if self.structured.reasoning else ""
            self.structured.add(ids, params.structured_outputs, tail)
        added = []
        try:
            for seq in sequences:
                self.scheduler.add_request(seq.request)
                added.append(seq.request.request_id)
        except Exception:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            for rid in ids:
                self.structured.remove(rid)
            raise
        scores = None if params.prompt_logprobs is None else PromptScores(len(token_ids))
        group = Group(request_id, text, token_ids, sequences, now, scores)
        self.groups[request_id] = group
        if params.needs_output_history:
            self._needs_history.add(request_id)
        for seq in sequences:
            self._seq_of[seq.request.request_id] = (group, seq)

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        self._needs_history.discard(request_id)
        ids = [s.request.request_id for s in group.sequences]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self._seq_of.pop(rid, None)
            self.runner.release(rid)
            self.structured.remove(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or self._in_flight is not None or self._undelivered is not None

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of every request that changed.

        With async scheduling one step stays in flight: this call schedules and launches step
        N+1 (its pending tokens come from step N on the device), then waits for step N's
        tokens and processes them, so the host's work overlaps the device's. The outputs are
        therefore one step behind the launches; the tokens are the same.
        """
        started = time.perf_counter()
        outputs: list[RequestOutput] = []
        previous, self._in_flight = self._in_flight, None
        landed = previous is not None  # this call lands the step ahead
        undelivered, self._undelivered = self._undelivered, None
        k = self._num_drafts  # chosen at the end of the last step (runtime/spec_policy.py)
        if previous is not None and not self._overlap(k):
            outputs, previous = self._process(previous), None
        # Drafts need the last tokens on the host; a grammar cuts them to what it accepts.
        asked = self.runner.propose(self.scheduler.running, self.structured.check_drafts, k)
        if self.spec_policy is not None:
            for request, room in asked:
                self.spec_policy.observe_proposal(room, len(request.spec_token_ids))
        step = self.scheduler.schedule()
        launched = None
        if step.scheduled:
            # A step with grammars samples after the previous step's tokens advance them: its
            # masks are computed while its forward runs.
            masked = self.structured.constrains([it.request for it in step.scheduled])
            launched = self.runner.launch(step, previous, defer_sampling=masked)
        if undelivered is not None:  # the last step's text, while this one runs
            outputs += self._deliver(*undelivered)
        if previous is not None:
            outputs += self._process(previous)
        if launched is not None and launched.logits is not None:
            masks = self.structured.bitmask(launched.sampling, launched.drafts)
            self.runner.sample(launched, masks)
        if launched is not None:
            if launched.spec is None:
                self._num_drafts = self._choose_drafts()
            if launched.spec is None and self._overlap(self._num_drafts):
                self._in_flight = launched
            else:  # drafts are verified at once
                result = self._advance(launched)
                if self._defer_delivery():
                    self._undelivered = (launched, result)
                else:
                    outputs += self._deliver(launched, result)
                self._num_drafts = self._choose_drafts()
        elapsed = time.perf_counter() - started
        if self.spec_policy is not None and launched is not None:
            # A call's time is one step's when it landed the step ahead and left its own in
            # flight, or did neither; a change of mode lands two steps or none (not timed).
            overlapped = self._in_flight is not None
            one_step = overlapped == landed
            self.spec_policy.observe_step(
                step.num_batched_tokens,
                elapsed if one_step else 0.0,
                launched.spec is not None,
                overlapped=overlapped,
            )
        self.runner.counters.busy_s += elapsed
        return outputs

    def _overlap(self, num_drafts: int | None) -> bool:
        # Penalties and proposals read each request's last tokens on the host; a step that
        # takes no drafts (the policy chose k = 0) proposes nothing.
        speculating = num_drafts != 0 and self.scheduler.speculating()
        return self.config.async_scheduling and not (self._needs_history or speculating)

    def _defer_delivery(self) -> bool:
        """Whether a step processed at once (speculation) leaves its text, stop strings and
        outputs for the next step's call, after that step's launch: its host work then runs
        beside the device's. Not with a grammar (its next drafts and masks need the text),
        penalties or synchronous scheduling (whose step returns its own tokens)."""
        return (
            self.config.async_scheduling and not self._needs_history and not self.structured.states
        )

    def _choose_drafts(self) -> int | None:
        """The next step's k (None: num_speculative_tokens, no policy): from the policy's
        step costs and acceptance, for the running requests as they stand."""
        policy = self.spec_policy
        if policy is None or not self.scheduler.speculating():
            return None
        running = self.scheduler.running
        budget = self.scheduler.config.max_num_batched_tokens
        num_tokens = min(
            budget, sum(r.num_tokens_with_pending - r.num_computed_tokens for r in running)
        )
        drafting = sum(map(Speculator.may_draft, running))
        return policy.choose(max(num_tokens, 1), len(running), drafting).k

    def _process(self, flight: InFlightStep) -> list[RequestOutput]:
        """Deliver a launched step's tokens: scheduler update, stop strings, text."""
        return self._deliver(flight, self._advance(flight))

    def _advance(self, flight: InFlightStep) -> RunnerOutput:
        """Wait for a launched step's tokens and advance the scheduler by them (eos, length,
        the next step's pending tokens); what the next step's proposals and schedule need."""
        result = self.runner.collect(flight)
        if self.spec_policy is not None and flight.spec is not None:
            for item in flight.step.scheduled:  # before a stop cuts the tokens
                if item.draft_token_ids:
                    accepted = len(result.sampled[item.request.request_id]) - 1
                    self.spec_policy.observe_verified(len(item.draft_token_ids), accepted)
        self.scheduler.update_from_output(flight.step, result.sampled)
        return result

    def _deliver(self, flight: InFlightStep, result: RunnerOutput) -> list[RequestOutput]:
        """An advanced step's tokens to its requests: stop strings, grammars, text, outputs."""
        step = flight.step
        changed: dict[str, Group] = {}
        for rid, (first, scores) in result.prompt_logprobs.items():
            if (entry := self._seq_of.get(rid)) is not None:
                entry[0].prompt_scores.add(first, scores)
        for rid, tokens in result.sampled.items():
            entry = self._seq_of.get(rid)
            if entry is None or entry[1].finished_seen:  # a step launched before it finished
                continue
            group, seq = entry
            changed[group.request_id] = group
            dropped = seq.deliver(tokens, result.logprobs.get(rid))
            if dropped is not None:  # a stop string
                stop, reason = RequestStatus.FINISHED_STOPPED, seq.detokenizer.stop_reason
                if not seq.request.is_finished:
                    self.scheduler.finish_requests(rid, stop, reason)
                elif dropped:  # finished by the scheduler at an accepted draft after it
                    seq.request.status, seq.request.stop_reason = stop, reason
            if rid in self.structured.states and not seq.request.is_finished:
                text = seq.detokenizer.text if seq.detokenizer is not None else ""
                if self.structured.advance(seq.request, text):  # the grammar is complete
                    self.scheduler.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
        for item in step.scheduled:
            # Requests finished by the scheduler this step (eos, length) flush held-back text.
            entry = self._seq_of.get(item.request.request_id)
            if entry is not None and item.request.is_finished:
                changed[entry[0].request_id] = entry[0]
        return [self._emit(group) for group in changed.values() if group.ready]

    def _emit(self, group: Group) -> RequestOutput:
        outputs = []
        for i, seq in enumerate(group.sequences):
            request = seq.request
            if request.is_finished and not seq.finished_seen:
                seq.finished_seen = True
                self.runner.release(request.request_id)
                self.structured.remove(request.request_id)
                if seq.detokenizer is not None and not seq.detokenizer.stopped:
                    seq.delta_text += seq.detokenizer.flush()
            text = seq.detokenizer.text if seq.detokenizer is not None else ""
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(request.output_token_ids),
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    delta_text=seq.delta_text,
                    delta_token_ids=seq.delta_tokens,
                )
            )
            seq.delta_text, seq.delta_tokens = "", []
        finished = group.finished
        if finished:
            self.groups.pop(group.request_id, None)
            self._needs_history.discard(group.request_id)
            for seq in group.sequences:
                self._seq_of.pop(seq.request.request_id, None)
        scores = group.prompt_scores.entries if group.prompt_scores is not None else None
        return RequestOutput(
            group.request_id, group.prompt, group.prompt_token_ids, outputs, finished, scores
        )
