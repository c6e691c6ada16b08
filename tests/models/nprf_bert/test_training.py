"""NPRF-BERT end to end: Trainer on an order-dependent synthetic task, saving the best
checkpoint, reloading it with trust_remote_code in a fresh process without hf_kernattn, and
MLM pre-training whose loss falls."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import (
    BertTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

import hf_kernattn
from tests.remote import run_without_package

FILLER = list("abcdefgh")
VOCAB = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + FILLER + ["x", "y"])}
# Dev accuracy the trained model must reach, and its required margin over the majority class.
MIN_ACCURACY = 0.90
MIN_MARGIN_OVER_MAJORITY = 0.30


def tokenizer() -> BertTokenizer:
    return BertTokenizer(vocab=dict(VOCAB))


def order_task(tok: BertTokenizer, n: int, seed: int) -> Dataset:
    """Random filler strings with one ``x`` and one ``y`` inserted; label 1 iff ``x`` comes first.

    Every example holds the same multiset of special tokens, so the label depends only on order:
    a model without any position information is permutation invariant and stays at chance.
    """
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        toks = [rng.choice(FILLER) for _ in range(rng.randint(6, 14))]
        i, j = sorted(rng.sample(range(len(toks) + 2), 2))
        label = rng.randint(0, 1)
        first, second = ("x", "y") if label else ("y", "x")
        toks.insert(i, first)
        toks.insert(j, second)
        texts.append(" ".join(toks))
        labels.append(label)
    ds = Dataset.from_dict({"text": texts, "label": labels})
    return ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])


def classifier_config(rpe: str = "learned") -> hf_kernattn.NPRFBertConfig:
    # No absolute positions: the relative-position bias is the only source of order information.
    return hf_kernattn.NPRFBertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        num_random_features=16, max_relative_position=16, position_embedding_type="none", rpe=rpe,
        rpe_init_std=0.5, initializer_range=0.1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=2,
    )


def accuracy(pred) -> dict[str, float]:
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


def train(config, out_dir, train_ds, dev_ds, tok, save: bool) -> Trainer:
    torch.manual_seed(0)
    model = hf_kernattn.NPRFBertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=str(out_dir), max_steps=300, per_device_train_batch_size=32, per_device_eval_batch_size=64,
        learning_rate=2e-3, warmup_steps=20, eval_strategy="steps", eval_steps=100,
        save_strategy="steps" if save else "no", save_steps=100, save_total_limit=1,
        load_best_model_at_end=save, metric_for_best_model="accuracy", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, logging_steps=100,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=train_ds, eval_dataset=dev_ds, processing_class=tok,
        data_collator=DataCollatorWithPadding(tok), compute_metrics=accuracy,
    )
    trainer.train()
    return trainer


@pytest.mark.slow
def test_trainer_learns_order_task_and_checkpoint_reloads_without_package(tmp_path):
    tok = tokenizer()
    train_ds, dev_ds = order_task(tok, 4000, seed=0), order_task(tok, 400, seed=1)
    majority = max(np.mean(dev_ds["label"]), 1 - np.mean(dev_ds["label"]))

    trainer = train(classifier_config(), tmp_path / "run", train_ds, dev_ds, tok, save=True)
    acc = trainer.evaluate()["eval_accuracy"]
    assert acc >= MIN_ACCURACY, f"dev accuracy {acc:.3f} < {MIN_ACCURACY}"
    assert acc - majority >= MIN_MARGIN_OVER_MAJORITY, f"dev accuracy {acc:.3f} vs majority {majority:.3f}"

    # Control: the same model without the relative-position bias has no order information.
    control = train(classifier_config(rpe="none"), tmp_path / "control", train_ds, dev_ds, tok, save=False)
    control_acc = control.evaluate()["eval_accuracy"]
    assert control_acc <= majority + 0.1, f"order-blind control reached {control_acc:.3f}: the task leaks order-free cues"

    # Save the best checkpoint Hub-ready and reload it where hf_kernattn cannot be imported.
    best = tmp_path / "best"
    trainer.save_model(str(best))
    saved = sorted(p.name for p in best.iterdir())
    for name in ("config.json", "model.safetensors", "configuration_nprf_bert.py", "modeling_nprf_bert.py",
                 "attention.py", "kernels_common.py", "state.py", "kernels_fft.py", "kernels_windowed.py",
                 "tokenizer_config.json"):
        assert name in saved, f"{name} missing from the saved checkpoint: {saved}"
    model = trainer.model.eval()
    batch = tok(["a x b c y", "y d d x e f g h a"], padding=True, return_tensors="pt")
    with torch.no_grad():
        local = model(**batch).logits
    (tmp_path / "inputs.json").write_text(json.dumps({k: v.tolist() for k, v in batch.items()}))
    out = run_without_package(
        f"""
        import json, torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        model = AutoModelForSequenceClassification.from_pretrained({str(best)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        tok = AutoTokenizer.from_pretrained({str(best)!r})
        inputs = {{k: torch.tensor(v) for k, v in json.load(open({str(tmp_path / "inputs.json")!r})).items()}}
        assert tok(["a x b c y", "y d d x e f g h a"], padding=True)["input_ids"] == inputs["input_ids"].tolist()
        with torch.no_grad():
            logits = model(**inputs).logits
        print("LOGITS " + json.dumps(logits.tolist()))
        """,
        cwd=str(tmp_path),
    )
    remote = torch.tensor(json.loads(out.split("LOGITS ", 1)[1]))
    torch.testing.assert_close(remote, local, rtol=0, atol=0)


def test_mlm_loss_falls():
    tok = tokenizer()
    rng = random.Random(0)
    # Cyclic runs of the filler alphabet: a masked token is predictable from its neighbours.
    texts = []
    for _ in range(256):
        start, length = rng.randrange(8), rng.randint(8, 16)
        texts.append(" ".join(FILLER[(start + t) % 8] for t in range(length)))
    enc = [tok(t) for t in texts]
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15, seed=0)
    config = hf_kernattn.NPRFBertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        num_random_features=16, max_relative_position=16, max_position_embeddings=32, rpe_init_std=0.5,
        initializer_range=0.1, hidden_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = hf_kernattn.NPRFBertForMaskedLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(120):
        batch = collator([enc[(step * 16 + i) % len(enc)] for i in range(16)])
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert first > 2.0, f"initial MLM loss {first:.3f} should be near ln(vocab)={np.log(len(VOCAB)):.2f}"
    assert last < 0.5 * first, f"MLM loss did not fall enough: {first:.3f} -> {last:.3f}"
