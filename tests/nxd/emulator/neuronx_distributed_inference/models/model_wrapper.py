"""ModelWrapper: what NxDI does around each traced submodel, before and after the device call.

- every int64 input becomes int32 (``convert_int64_to_int32``);
- inputs are padded to the first bucket that fits (``pad_inputs``): context encoding pads
  input_ids with ``pad_token_id``, attention_mask with 0 and position_ids with 1; token generation
  pads only the attention mask. Bucket choice needs ``len + speculation_length < bucket`` or
  ``== largest``, else ValueError;
- a batch equal to the compiled batch runs as given (row i is KV line i for token generation);
  a larger one runs in compiled-size slices; a smaller one goes through ``_forward_with_pad``:
  seq_ids are completed with the missing ids and sorted, rows reordered, pad rows repeat the
  caller's first row (and so write KV into the lines they stand for), and the outputs are
  index-selected back by seq_id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"
FUSED_SPECULATION_MODEL_TAG = "fused_speculation_model"

Outputs = torch.Tensor | list[torch.Tensor]
Traced = Callable[..., Outputs]


class ModelWrapper:
    def __init__(
        self,
        tag: str,
        traced: Traced,
        *,
        batch_size: int,
        buckets: list[int],
        pad_token_id: int,
        max_context_length: int,
        max_length: int,
        speculation_length: int = 0,
        allow_input_truncation: bool = False,
        apply_seq_ids_mask: bool = False,
    ) -> None:
        self.tag = tag
        self.traced = traced
        self.batch_size = batch_size
        self.buckets = buckets
        self.pad_token_id = pad_token_id
        self.max_context_length = max_context_length
        self.max_length = max_length
        self.speculation_length = speculation_length if tag == FUSED_SPECULATION_MODEL_TAG else 0
        self.allow_input_truncation = allow_input_truncation
        self.apply_seq_ids_mask = apply_seq_ids_mask

    # -- the call ----------------------------------------------------------------------------------
    def forward(self, *args: torch.Tensor) -> Outputs:
        args = tuple(self.convert_int64_to_int32(*args))
        args = self.pad_inputs(*args)
        seq_ids = args[3]
        input_batch_size = seq_ids.shape[0]
        if input_batch_size == self.batch_size:
            return self.traced(*args)
        outputs: list[Outputs] = []
        cur = 0
        while cur < input_batch_size:
            if cur + self.batch_size <= input_batch_size:
                batch_args = [a[cur : cur + self.batch_size] for a in args]
                outputs.append(self.traced(*self._cte_repadding(batch_args)))
            else:
                outputs.append(self._forward_with_pad(*[a[cur:input_batch_size] for a in args]))
            cur += self.batch_size
        if isinstance(outputs[0], list):
            return [torch.cat(parts, dim=0) for parts in zip(*outputs, strict=True)]  # type: ignore[arg-type]
        return torch.cat(outputs, dim=0)  # type: ignore[arg-type]

    __call__ = forward

    @staticmethod
    def convert_int64_to_int32(*args: torch.Tensor) -> list[torch.Tensor]:
        return [t.to(torch.int32) if t.dtype == torch.int64 else t for t in args]

    # -- buckets and padding -----------------------------------------------------------------------
    def get_target_bucket(self, input_len: int) -> int:
        required = input_len + self.speculation_length
        largest = self.buckets[-1]
        for bucket in self.buckets:
            if required < bucket:
                return bucket
        if required == largest or self.allow_input_truncation:
            return largest
        raise ValueError(f"Input len {input_len} exceeds largest bucket ({largest}) for {self.tag}")

    def pad_inputs(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pad_length = self.get_target_bucket(args[1].shape[1])
        if self.tag == CONTEXT_ENCODING_MODEL_TAG:
            to_pad = args[:3]
            pad_lengths = [pad_length - a.shape[1] for a in to_pad]
            if any(n < 0 for n in pad_lengths):
                raise ValueError(
                    f"Inputs supplied ({to_pad[1].shape[1]} tokens) are longer than max_context_length "
                    f"({self.max_context_length} tokens). To truncate inputs, set allow_input_truncation=True."
                )
            padded = [
                F.pad(a, (0, n), "constant", v)
                for a, v, n in zip(to_pad, (self.pad_token_id, 0, 1), pad_lengths, strict=True)
            ]
            return (*padded, *args[3:])
        input_ids, attention_mask, *rest = args
        pad_len = pad_length - attention_mask.shape[1]
        if pad_len < 0:
            raise ValueError(
                f"Attention mask supplied (length={attention_mask.shape[1]}) is longer than max_length "
                f"({self.max_length} tokens). To truncate attention mask, set allow_input_truncation=True."
            )
        return (input_ids, F.pad(attention_mask, (0, pad_len), "constant", 0), *rest)

    def _cte_repadding(self, batch_args: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # Undo a caller's right padding (assumed to be position 0) and re-pad to this slice's bucket.
        actual_len = int(torch.max(batch_args[2])) + 1
        for i in range(3):
            batch_args[i] = batch_args[i][:, :actual_len]
        return self.pad_inputs(*batch_args)

    # -- a batch smaller than the compiled one -------------------------------------------------------
    def _forward_with_pad(self, *args: torch.Tensor) -> Outputs:
        seq_ids, sampling_params = args[3], args[4]
        target = self.batch_size
        seq_list = seq_ids.tolist()
        padded_seq_ids = torch.tensor(seq_list + [x for x in range(target) if x not in seq_list], dtype=seq_ids.dtype)
        padded_seq_ids, indices = torch.sort(padded_seq_ids)
        if self.apply_seq_ids_mask:
            present = torch.tensor([x in seq_list for x in range(target)])
            padded_seq_ids = torch.where(present, padded_seq_ids, torch.full_like(padded_seq_ids, -1))
        padded = [self._repeat_first_line(a, indices) for a in args[:3]]
        padded.append(padded_seq_ids[:target])
        padded.append(self._repeat_first_line(sampling_params, indices))
        outputs = self.traced(*padded)
        if isinstance(outputs, list):
            return [torch.index_select(o, 0, seq_ids.long()) for o in outputs]
        return torch.index_select(outputs, 0, seq_ids.long())

    def _repeat_first_line(self, tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[0] = self.batch_size
        padded = tensor[:1].expand(*shape).clone()
        padded[: tensor.shape[0]] = tensor
        return torch.index_select(padded, 0, indices)

