"""transformers' Trainer on coda's own model and on a patched model (tiny Llama, fp32): the logged
losses, the eval loss and the trained weights are the HF model's under the same Trainer, with gradient
accumulation over padded batches (Trainer's num_items_in_batch), activation checkpointing, packed
documents (DataCollatorWithFlattening), bf16 autocast, label smoothing, and a run resumed from a saved
checkpoint. What Trainer reads of coda's model: coda/models/hf_interface.py."""

from __future__ import annotations

import copy
import inspect
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer's own dependency

import coda  # noqa: E402
from conftest import DEVICE, rel  # noqa: E402

VOCAB, SEQ = 64, 8
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


# transformers 5.24's name for it; 5.17 (the GPU machine's) has gradient_checkpointing alone
CHECKPOINTING = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                     if name in inspect.signature(transformers.TrainingArguments).parameters)


def hf_llama(**kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, **kw)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def dataset(n: int = 8) -> list[dict[str, torch.Tensor]]:
    """Right-padded rows with 0-5 pads each: the micro-batches hold different numbers of labels, so the
    loss under gradient accumulation depends on Trainer's num_items_in_batch reaching the model."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        live = SEQ - i % 6
        mask = (torch.arange(SEQ) < live).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def train(model: torch.nn.Module, out: str, *, steps: int = 4, resume: str | None = None,
          save_steps: int | None = None, **extra: object) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
        learning_rate=1e-3, logging_steps=1, report_to=[], seed=0, use_cpu=DEVICE.type == "cpu",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, disable_tqdm=True,
        **{CHECKPOINTING: True}, **extra)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(16), eval_dataset=dataset(4))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def losses(trainer: transformers.Trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def test_trainer_trains_coda_model_as_the_hf_one(tmp_path) -> None:
    ref = hf_llama()
    model = coda.models.from_hf(copy.deepcopy(ref))
    hf_run = train(ref, str(tmp_path / "hf"))
    coda_run = train(model, str(tmp_path / "coda"))
    assert model.checkpoint, "Trainer's activation checkpointing turns the layer recomputation on"
    assert len(losses(coda_run)) == 4
    assert losses(coda_run) == pytest.approx(losses(hf_run), rel=1e-5)
    assert coda_run.evaluate()["eval_loss"] == pytest.approx(hf_run.evaluate()["eval_loss"], rel=1e-5)
    coda_run.args.use_liger_kernel = True  # (evaluation then passes Liger-Kernel's skip_logits=True)
    assert coda_run.evaluate()["eval_loss"] == pytest.approx(hf_run.evaluate()["eval_loss"], rel=1e-5)
    trained = model.to_hf_state_dict()
    for name, p in ref.state_dict().items():
        assert rel(trained[name], p) < 1e-4, name


@pytest.mark.slow
def test_trainer_trains_coda_model_under_bf16_autocast(tmp_path) -> None:
    """bf16=True: Trainer runs the forward under autocast and accelerate rebuilds the output as
    type(out)({...}) to convert it to fp32; the losses are the HF model's within bf16's rounding (2^-8)."""
    hf_run = train(hf_llama(), str(tmp_path / "hf"), steps=2, bf16=True)
    coda_run = train(coda.models.from_hf(hf_llama()), str(tmp_path / "coda"), steps=2, bf16=True)
    assert len(losses(coda_run)) == 2 and losses(coda_run) == pytest.approx(losses(hf_run), rel=2**-8)


@pytest.mark.slow
def test_trainer_label_smoothing_as_hf(tmp_path) -> None:
    """label_smoothing_factor: Trainer takes the labels, calls the model without them and smooths
    the loss over the returned logits, shifted because the class name is a causal LM's."""
    hf_run = train(hf_llama(), str(tmp_path / "hf"), steps=2, label_smoothing_factor=0.1)
    coda_run = train(coda.models.from_hf(hf_llama()), str(tmp_path / "coda"), steps=2, label_smoothing_factor=0.1)
    assert len(losses(coda_run)) == 2 and losses(coda_run) == pytest.approx(losses(hf_run), rel=1e-5)


def test_trainer_trains_packed_documents_as_hf(tmp_path) -> None:
    """transformers' DataCollatorWithFlattening packs each micro-batch into one row with position_ids
    restarting per document: coda's model masks attention per document as the HF model does."""
    g = torch.Generator().manual_seed(3)
    rows = [{"input_ids": torch.randint(0, VOCAB, (int(n),), generator=g).tolist()}
            for n in torch.randint(3, 9, (16,), generator=g)]
    runs = []
    for model in (hf_llama(), coda.models.from_hf(hf_llama())):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / type(model).__module__), per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, logging_steps=1, report_to=[], seed=0,
            use_cpu=DEVICE.type == "cpu", save_strategy="no", disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                       data_collator=transformers.DataCollatorWithFlattening())
        trainer.train()
        runs.append(losses(trainer))
    assert len(runs[1]) == 3 and runs[1] == pytest.approx(runs[0], rel=1e-5)


@pytest.mark.slow
def test_trainer_resumes_coda_model_from_its_checkpoint(tmp_path) -> None:
    """Trainer saves the coda model's own state_dict (model.safetensors, coda's layouts) and loads it
    back on resume: a fresh model resumed from step 2 ends where the uninterrupted run does."""
    whole = coda.models.from_hf(hf_llama())
    train(whole, str(tmp_path / "whole"), save_steps=2)
    resumed = coda.models.from_hf(hf_llama())
    with torch.no_grad():
        for p in resumed.parameters():  # so that only the checkpoint can bring the trained weights
            p.zero_()
    run = train(resumed, str(tmp_path / "resumed"), resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert run.state.global_step == 4
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert rel(a, b) < 1e-5, name


def test_trainer_trains_a_patched_model_as_the_unpatched_one(tmp_path) -> None:
    ref = hf_llama()
    model = coda.patch(copy.deepcopy(ref))
    hf_run = train(ref, str(tmp_path / "hf"))
    patched_run = train(model, str(tmp_path / "patched"))
    assert losses(patched_run) == pytest.approx(losses(hf_run), rel=1e-5)
    trained = model.state_dict()
    for name, p in ref.state_dict().items():
        assert rel(trained[name], p) < 1e-4, name


def test_coda_model_takes_the_loss_arguments_as_keywords_only() -> None:
    """The loss's arguments are **kwargs, as in transformers' models (Trainer reads the signature to
    find the labels and to pass num_items_in_batch); a misspelt one is refused, not dropped."""
    model = coda.models.from_hf(hf_llama())
    ids = dataset(2)[0]["input_ids"][None]
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['num_items'\]"):
        model(ids, labels=ids, num_items=3)
    assert transformers.utils.generic.find_labels(type(model)) == ["labels"]
    out = model(ids, labels=ids)
    out_loss = out.loss
    assert out["loss"] is out[0] is out.loss and out.logits is None and list(out) == ["loss"]
    assert type(out)({"loss": out.loss})["loss"] is out.loss  # dict's constructor, as mapping tools rebuild it
    out = model(ids)
    assert out.loss is None and out[0] is out.logits and json.dumps(list(out)) == '["logits"]'
    assert model(ids, labels=ids, skip_logits=True).loss == out_loss
    for kw in (dict(labels=ids, skip_logits=False), dict(skip_logits=True)):
        with pytest.raises(ValueError, match="never materialized"):
            model(ids, **kw)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_transformers(tied: bool) -> None:
    """Trainer's FLOPs estimate (total_flos) reads num_parameters(exclude_embeddings=True)."""
    ref = hf_llama(tie_word_embeddings=tied)
    model = coda.models.from_hf(ref)
    for kw in (dict(), dict(exclude_embeddings=True), dict(only_trainable=True)):
        assert model.num_parameters(**kw) == ref.num_parameters(**kw), kw
    model.embed_tokens.requires_grad_(False)
    assert model.num_parameters(only_trainable=True) == model.num_parameters(exclude_embeddings=True)


def test_accelerate_fsdp2_wraps_each_layer() -> None:
    """Trainer's FSDP2 (accelerate, transformer-based wrapping) reads `_no_split_modules`: each
    LlamaLayer its own group, as docs/MODEL.md shards the model."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    model = coda.models.from_hf(hf_llama())
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert [name for name, module in model.named_modules() if policy(module)] == ["layers.0", "layers.1"]


def test_checkpointing_options_coda_lacks_are_refused() -> None:
    model = coda.models.from_hf(hf_llama())
    model.gradient_checkpointing_enable({"use_reentrant": True})
    assert model.checkpoint and model.is_gradient_checkpointing
    model.gradient_checkpointing_disable()
    assert not model.checkpoint
    with pytest.raises(ValueError, match="every_n_layers=2"):
        model.activation_checkpointing_enable(every_n_layers=2)
    with pytest.raises(ValueError, match=r"options \['preserve_rng_state'\]"):
        model.activation_checkpointing_enable({"preserve_rng_state": False})
    model.config.use_cache = False  # what Trainer sets; the rest stays frozen
    with pytest.raises(AttributeError):
        model.config.hidden_size = 8
    logged = json.loads(model.config.to_json_string())  # what Trainer's reporting callbacks log
    assert logged["hidden_size"] == 32 and logged["use_cache"] is False and logged == model.config.to_dict()
