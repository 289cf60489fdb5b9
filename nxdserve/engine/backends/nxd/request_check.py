"""What an NxD configuration can serve, as a small picklable check: the engine runs it at admission, and a
data-parallel front end runs the same one (sent in ``EngineFacts``) so that a request it cannot serve is a 400
before its stream opens, as with one engine."""

from __future__ import annotations

from dataclasses import dataclass

from nxdserve.errors import InvalidRequestError
from nxdserve.sampling_params import SamplingParams


def cpu_sampling_features(params: SamplingParams) -> list[str]:
    """The request's parameters that on-device sampling cannot apply (empty: NxD can sample it)."""
    used = {
        "logprobs": params.logprobs is not None,
        "min_p": params.min_p > 0.0,
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
        "logit_bias": bool(params.logit_bias),
        "min_tokens": params.min_tokens > 0,
        "seed": params.seed is not None and not params.is_greedy,  # NxD samples with the device's RNG
        # issue 27: token masks (grammars, allowed ids, bad words) apply to the logits on the host
        "structured_outputs": params.structured_outputs is not None,
        "allowed_token_ids": bool(params.allowed_token_ids),
        "bad_words": bool(params.bad_words),
    }
    return [name for name, on in used.items() if on]


@dataclass(frozen=True)
class NxdRequestCheck:
    sampling_mode: str  # NxdSettings.sampling_mode: device | hybrid | cpu
    fused: bool

    def __call__(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError for what this NxD configuration cannot serve."""
        if params.prompt_logprobs is not None:
            raise InvalidRequestError(
                "prompt_logprobs is not available on the nxd backend: NxD context encoding returns the last "
                "position's logits only.",
                param="prompt_logprobs",
            )
        needs = cpu_sampling_features(params)
        if not needs or self.sampling_mode != "device":
            return
        if self.fused:
            how = "fused speculation samples on device; start without --speculative-config to use them"
        else:
            how = (
                "start the server with --override-neuron-config '{\"output_logits\": true}' (NxD also returns "
                "logits, and such requests are sampled on CPU) or '{\"on_device_sampling_config\": null}' "
                "(all sampling on CPU)"
            )
        raise InvalidRequestError(
            f"This server samples on the Neuron device, which cannot apply {', '.join(needs)}: {how}.",
            param=needs[0],
        )
