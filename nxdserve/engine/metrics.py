"""Prometheus metrics under vLLM's names, so existing dashboards and `vllm bench serve` work."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from nxdserve.engine.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's 1-2-5 series for the per-request token counts (it stops at max_model_len; these at 2M tokens)
_REQUEST_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
_FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    def __init__(self, model_name: str, max_spec_tokens: int = 0) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.num_running = Gauge("vllm:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.num_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV slots in use (0-1)", labels, registry=r)
        # Each request's prompt once (vLLM's meaning), whatever prefix caching or a preemption recomputed
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=r
        )
        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, labels, buckets=buckets, registry=r)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end latency", _LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time waiting for a slot", _LATENCY_BUCKETS)
        # Per finished request, as vLLM's (docs: the request_* histograms)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Mean time per output token of a request", _ITL_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of a request",
                                               _REQUEST_TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Tokens generated for a request", _REQUEST_TOKEN_BUCKETS)
        self.request_inference_time = histogram("vllm:request_inference_time_seconds",
                                                "Time from first scheduled to finished", _LATENCY_BUCKETS)
        self.request_prefill_time = histogram("vllm:request_prefill_time_seconds",
                                              "Time from first scheduled to first token", _LATENCY_BUCKETS)
        self.request_decode_time = histogram("vllm:request_decode_time_seconds",
                                             "Time from first token to last token", _LATENCY_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step",
                                          _ITERATION_TOKEN_BUCKETS)
        self.spec_num_drafts = Counter("vllm:spec_decode_num_drafts", "Draft rounds", labels, registry=r)
        self.spec_num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", labels, registry=r
        )
        self.spec_num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted drafts per position",
            [*labels, "position"], registry=r,
        )
        # nxdserve's own: EAGLE's draft alternatives (docs/speculative.md); a hit also counts as an accepted
        # draft token at position 0 above.
        self.spec_num_alternatives = Counter(
            "nxdserve:spec_decode_num_alternative_tokens", "Draft alternatives verified", labels, registry=r
        )
        self.spec_num_alternative_hits = Counter(
            "nxdserve:spec_decode_num_alternative_hits", "Draft alternatives accepted", labels, registry=r
        )
        # Prefix caching: prompt tokens of admitted requests, and how many of them were found in the slot.
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r
        )
        # --scheduling-policy priority: requests that gave their slot up to a better one (vLLM's counter).
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine", labels, registry=r
        )
        self._model = model_name
        self._last_token_time: dict[str, float] = {}
        for gauge in (self.num_running, self.num_waiting, self.kv_usage):
            gauge.labels(model_name).set(0)
        # The one model's children, looked up once: ``labels()`` takes a lock and builds a key each call, and
        # these run per step and per streamed token on the event loop.
        m = model_name
        self._running, self._waiting, self._kv = (self.num_running.labels(m), self.num_waiting.labels(m),
                                                  self.kv_usage.labels(m))
        self._prompt_tokens, self._generation_tokens = self.prompt_tokens.labels(m), self.generation_tokens.labels(m)
        self._iteration_tokens, self._ttft, self._itl = (self.iteration_tokens.labels(m), self.ttft.labels(m),
                                                         self.itl.labels(m))
        self._e2e, self._queue_time = self.e2e.labels(m), self.queue_time.labels(m)
        self._request_histograms = tuple(h.labels(m) for h in (
            self.request_tpot, self.request_prompt_tokens, self.request_generation_tokens,
            self.request_inference_time, self.request_prefill_time, self.request_decode_time))
        # Counters read with rate() show 0, not "no data", before their first event (vLLM creates them too)
        for reason in _FINISH_REASONS:
            self.request_success.labels(m, reason)
        for counter in (self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions,
                        self.spec_num_drafts, self.spec_num_draft_tokens, self.spec_num_accepted_tokens):
            counter.labels(m)
        for pos in range(max_spec_tokens):
            self.spec_accepted_per_pos.labels(m, str(pos))
        self.lora_info: Gauge | None = None  # created by the first record_lora (engines with --enable-lora)
        self._lora_key: tuple[str, str, str] | None = None

    def record_step(self, num_running: int, num_waiting: int, kv_usage: float,
                    num_generated: int, num_scheduled: int) -> None:
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv.set(kv_usage)
        if num_generated:
            self._generation_tokens.inc(num_generated)
        if num_scheduled:
            self._iteration_tokens.observe(num_scheduled)

    def record_lora(self, running: list[str], waiting: list[str], max_lora: int) -> None:
        """vLLM's ``vllm:lora_requests_info``: a gauge set to the current time under labels naming the running
        and waiting adapters (comma-joined) and max_lora. Only the latest label set is kept (vLLM keeps every
        set it has seen; one series per scrape is what dashboards read)."""
        if self.lora_info is None:
            self.lora_info = Gauge(
                "vllm:lora_requests_info", "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry,
            )  # fmt: skip
        key = (str(max_lora), ",".join(waiting), ",".join(running))
        if self._lora_key is not None and self._lora_key != key:
            self.lora_info.remove(*self._lora_key)
        self._lora_key = key
        self.lora_info.labels(*key).set_to_current_time()

    def record_preemptions(self, count: int) -> None:
        self.num_preemptions.labels(self._model).inc(count)

    def record_prefix_cache(self, num_queried: int, num_hits: int) -> None:
        self.prefix_cache_queries.labels(self._model).inc(num_queried)
        if num_hits:
            self.prefix_cache_hits.labels(self._model).inc(num_hits)

    def record_spec(self, num_drafts: int, num_draft_tokens: int, accepted_per_pos: list[int]) -> None:
        m = self._model
        self.spec_num_drafts.labels(m).inc(num_drafts)
        self.spec_num_draft_tokens.labels(m).inc(num_draft_tokens)
        self.spec_num_accepted_tokens.labels(m).inc(sum(accepted_per_pos))
        for pos, count in enumerate(accepted_per_pos):
            if count:
                self.spec_accepted_per_pos.labels(m, str(pos)).inc(count)

    def record_alternatives(self, num_alternatives: int, num_hits: int) -> None:
        self.spec_num_alternatives.labels(self._model).inc(num_alternatives)
        if num_hits:
            self.spec_num_alternative_hits.labels(self._model).inc(num_hits)

    def record_output(self, out: RequestOutput, now: float) -> None:
        metrics = out.metrics
        if out.outputs and out.outputs[0].token_ids:
            last = self._last_token_time.get(out.request_id)
            if last is None:
                if metrics.ttft is not None:
                    self._ttft.observe(metrics.ttft)
                self._prompt_tokens.inc(len(out.prompt_token_ids))
            else:
                self._itl.observe(now - last)
            self._last_token_time[out.request_id] = now
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            reason = out.outputs[0].finish_reason if out.outputs else "abort"
            self.request_success.labels(self._model, reason or "abort").inc()
            self._e2e.observe(now - metrics.arrival_time)
            if metrics.queue_time is not None:
                self._queue_time.observe(metrics.queue_time)
            self._record_request(out, now)

    def _record_request(self, out: RequestOutput, now: float) -> None:
        tpot, prompt_tokens, generation_tokens, inference, prefill, decode = self._request_histograms
        metrics = out.metrics
        generated = out.outputs[0].cumulative_num_tokens if out.outputs else 0
        prompt_tokens.observe(len(out.prompt_token_ids))
        generation_tokens.observe(generated)
        scheduled, first, last = metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time
        if scheduled is not None:
            inference.observe((metrics.finished_time or now) - scheduled)
            if first is not None:
                prefill.observe(first - scheduled)
        if first is not None and last is not None:
            decode.observe(last - first)
            if generated > 1:
                tpot.observe((last - first) / (generated - 1))
