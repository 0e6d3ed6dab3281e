"""What transformers' `Trainer` reads from a model that is not a `PreTrainedModel`, for coda's own model.

Trainer takes any `nn.Module` and, by convention:
* finds the label arguments by name in `forward`'s signature and passes `num_items_in_batch` only
  to a `forward` with `**kwargs` (so `LlamaForCausalLM.forward` takes the loss arguments as keywords);
* counts those items over `labels[..., 1:]` when `model.loss_type` names transformers' causal-LM loss;
* reads the loss as `out["loss"]` or `out[0]` (CausalLMOutput);
* sets `model.config.use_cache`, and its reporting callbacks log `model.config.to_dict()`
  (trainer_config);
* turns checkpointing on through `activation_checkpointing_enable` (transformers >= 5.24) or
  `gradient_checkpointing_enable`, and estimates FLOPs from `num_parameters(exclude_embeddings=True)`
  (TrainerInterface);
* under `use_liger_kernel=True` applies no kernels to a model outside transformers, but its
  evaluation passes Liger-Kernel's `skip_logits=True` with the labels, which `forward` takes (coda
  never forms logits with labels) and checks.
"""

from __future__ import annotations

import dataclasses
import json

import torch


class CausalLMOutput(dict):
    """`loss`: the loss (None without labels); `logits`: [B, S, V] (None when labels are given: they
    are never materialized). A dict of the fields that are set, in that order, as transformers'
    ModelOutput is: `out["loss"]` and `out[0]` read the loss when there is one."""

    def __init__(self, *args: object, **fields: torch.Tensor | None) -> None:
        # dict's own signature: tools that map over outputs rebuild them as type(out)({...}) (accelerate's
        # fp32 conversion under Trainer's bf16=True does)
        super().__init__(*args, **fields)
        for name in [k for k, v in self.items() if v is None]:
            del self[name]
        unknown = sorted(set(self) - {"loss", "logits"})
        if unknown:
            raise TypeError(f"CausalLMOutput holds loss and logits, not {unknown}")

    @property
    def loss(self) -> torch.Tensor | None:
        return self.get("loss")

    @property
    def logits(self) -> torch.Tensor | None:
        return self.get("logits")

    def __getitem__(self, key: str | int | slice):
        return tuple(self.values())[key] if isinstance(key, (int, slice)) else super().__getitem__(key)

    def to_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.values())


def trainer_config(cls: type) -> type:
    """A frozen dataclass as Trainer and its logging callbacks use a model's config: it takes
    `use_cache`, which Trainer sets on any model's config (for generation's KV cache; coda's model
    has none, so the value is kept and changes nothing, every other field staying frozen), and gives
    `to_dict()` and `to_json_string()`, which TensorBoard's, Weights & Biases', MLflow's and the other
    reporting callbacks log."""
    frozen = cls.__setattr__

    def __setattr__(self, name: str, value: object) -> None:
        if name == "use_cache":
            object.__setattr__(self, name, value)
        else:
            frozen(self, name, value)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if "use_cache" in self.__dict__:
            out["use_cache"] = self.use_cache
        return out

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    cls.__setattr__, cls.to_dict, cls.to_json_string = __setattr__, to_dict, to_json_string
    return cls


class TrainerInterface:
    """The loss's name, the parameter count and transformers' switches for recomputing each layer in
    backward, on a model with a `checkpoint` flag and an `embed_tokens` parameter. The recomputation
    is torch's non-reentrant checkpoint whatever `use_reentrant` says (both recompute the same
    values); options coda does not have are refused."""

    # transformers' ForCausalLMLoss (lm_loss.py computes it): Trainer then counts num_items_in_batch
    # over labels[..., 1:], the targets that loss divides by, as for transformers' own causal LMs.
    loss_type = "ForCausalLM"
    checkpoint: bool
    embed_tokens: torch.nn.Parameter

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """transformers' count (Trainer's FLOPs estimate reads it): every parameter once, or those
        that train, without the input embedding where asked (an untied LM head counts)."""
        return sum(p.numel() for p in self.parameters()
                   if (p.requires_grad or not only_trainable) and not (exclude_embeddings and p is self.embed_tokens))

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        unknown = sorted(set(activation_checkpointing_kwargs or {}) - {"use_reentrant"})
        if unknown or every_n_layers != 1 or offload:
            raise ValueError(f"{type(self).__name__}: checkpointing recomputes every layer, on the device "
                             f"(every_n_layers=1, offload=False), and takes no options but use_reentrant; got "
                             f"every_n_layers={every_n_layers}, offload={offload}, options {unknown}")
        self.checkpoint = True

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      every_n_layers: int = 1, offload: bool = False) -> None:
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers, offload)

    def activation_checkpointing_disable(self) -> None:
        self.checkpoint = False

    gradient_checkpointing_disable = activation_checkpointing_disable

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.checkpoint

    is_gradient_checkpointing = is_activation_checkpointing
