"""A pure-torch stand-in for NeuronX Distributed Inference (NxDI 0.9), for tests only.

It reproduces the parts of NxDI's *application contract* that a serving engine depends on, with the
same import paths, class names, signatures and semantics (see /work/shared/reference/nxd-api.md):
config classes, ``MODEL_TYPES``, ``load_pretrained_config``, compile/load/warm-up, and the
``forward`` of a causal-LM application (routing by ``position_ids.min() == 0``, int64 to int32,
bucketing and right padding, row-to-KV-line mapping, pad rows, sampling-parameter validation, length
errors, and outputs with ``tokens`` / ``logits`` / ``fused_outputs``).

The network itself is nxdserve's torch reference model over a slot KV cache, so greedy outputs can
be compared with the torch backend token for token. Nothing here is compiled; "compile" writes the
artifact files a real compile would, so artifact caching is exercised too.
"""
