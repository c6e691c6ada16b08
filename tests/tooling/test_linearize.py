"""Attention transfer (``hf-kernattn linearize``): the hooks feed every student layer the
teacher's own input, the loss is what the layers' outputs say, only the chosen weights train, a
stopped and resumed run ends bitwise where the whole run ends, and the result is saved Hub-ready."""

import json

import pytest
import torch

from hf_kernattn.convert.linearize import (
    attention_pairs,
    batch_for_step,
    linearize,
    select_trainable,
    token_blocks,
    transfer_hooks,
    transfer_loss,
)

V = 40


def _tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, V)}}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="<eos>")
    tok.save_pretrained(folder)
    return tok


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny GPT-2 (softmax attention), its word-level tokenizer and a training text, saved locally."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                               bos_token_id=1, eos_token_id=1,
                               initializer_range=0.3)).save_pretrained(folder)  # peaked softmax attention
    _tokenizer(folder)
    g = torch.Generator().manual_seed(1)
    text = folder / "train.txt"
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(2, V, (3000,), generator=g)))
    return folder, text


def test_hooks_feed_each_student_layer_the_teachers_input(source):
    from transformers import GPT2LMHeadModel

    from hf_kernattn.convert import convert

    folder, _ = source
    teacher = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    student = convert(folder, None, feature_map="elu").eval()
    pairs = attention_pairs(teacher, student, "gpt2")
    assert len(pairs) == 2
    ids = torch.randint(2, V, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # (transformers installs hooks of its own on a first forward)
        teacher(input_ids=ids, use_cache=False)
        student(input_ids=ids, use_cache=False)
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for pair in pairs for m in pair]
    with torch.no_grad(), transfer_hooks(pairs) as (t_out, s_out):
        teacher(input_ids=ids, use_cache=False)
        student(input_ids=ids, use_cache=False)
    # the hooks are gone afterwards (transformers' own stay)
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for pair in pairs for m in pair] == hooks
    # each student layer saw the teacher's input: replaying the student's attention on the
    # teacher's recorded layer input gives what the hook recorded, also for the second layer,
    # whose own input (the student's first layer's output) differs
    ln = [teacher.transformer.h[i].ln_1 for i in range(2)]
    hidden = teacher(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    for i, (_, _, attn) in enumerate(pairs):
        with torch.no_grad():
            again = attn(ln[i](hidden[i]))
        torch.testing.assert_close(s_out[i], again, rtol=0, atol=0)
    # the teacher's recorded attention output is what its first block adds to the residual stream
    block = teacher.transformer.h[0]
    with torch.no_grad():
        x = t_out[0] + hidden[0]
        torch.testing.assert_close(x + block.mlp(block.ln_2(x)), hidden[1], rtol=0, atol=0)
    loss, per_layer = transfer_loss(t_out, s_out)
    assert per_layer == [float(torch.mean((s - t) ** 2)) for t, s in zip(t_out, s_out)]
    assert float(loss) == pytest.approx(sum(per_layer) / 2)


def test_only_the_chosen_weights_train(source):
    from hf_kernattn.convert import convert

    folder, _ = source
    student = convert(folder, None, feature_map="elu")
    with pytest.raises(ValueError, match="nothing to train.*learned feature map"):
        select_trainable(student, "feature_maps")
    names = select_trainable(student, "attention")
    assert names and all(".attn." in n for n in names)
    assert all(p.requires_grad == (n in names) for n, p in student.named_parameters())
    with pytest.raises(ValueError, match="train must be one of"):
        select_trainable(student, "everything")


def test_batches_depend_on_step_and_seed_only():
    blocks = torch.arange(50).view(10, 5)
    a = [batch_for_step(blocks, s, 4, seed=3) for s in range(6)]
    b = [batch_for_step(blocks, s, 4, seed=3) for s in range(6)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    seen = torch.cat(a[:5])[:, 0] // 5  # the first 20 rows: two epochs, each a permutation of the 10 blocks
    assert sorted(seen[:10].tolist()) == list(range(10)) and sorted(seen[10:20].tolist()) == list(range(10))
    assert not torch.equal(torch.cat(a), torch.cat([batch_for_step(blocks, s, 4, seed=4) for s in range(6)]))


def test_token_blocks_refuse_too_little_text(source):
    from transformers import AutoTokenizer

    folder, _ = source
    tok = AutoTokenizer.from_pretrained(folder)
    blocks = token_blocks(tok, ["w2 w3 w4", "w5"], 2)
    assert blocks.tolist() == [[2, 3], [4, 1], [5, 1]]
    with pytest.raises(ValueError, match="fewer than one block"):
        token_blocks(tok, ["w2"], 8)


def test_transfer_lowers_the_loss_resumes_bitwise_and_saves_hub_ready(source, tmp_path):
    folder, text = source
    kw = dict(train_files=[str(text)], feature_map="elu", train="attention", steps=6, batch_size=4, block_size=16,
              learning_rate=3e-3, progress=False)
    whole = linearize(folder, tmp_path / "whole", **kw)
    report = whole.linearize_report
    assert sum(report["layer_loss_after"]) < sum(report["layer_loss_before"])
    assert report["trainable_parameter_count"] == sum(p.numel() for n, p in whole.named_parameters() if ".attn." in n)
    # stopped after 2 and then 3 more steps, resumed from the newest checkpoint each time
    assert linearize(folder, tmp_path / "parts", stop_after_steps=2, **kw).__dict__.get("linearize_report") is None
    linearize(folder, tmp_path / "parts", stop_after_steps=3, resume_from_checkpoint="latest", **kw)
    parts = linearize(folder, tmp_path / "parts", resume_from_checkpoint="latest", **kw)
    for (name, a), (_, b) in zip(whole.state_dict().items(), parts.state_dict().items()):
        assert torch.equal(a, b), name
    assert parts.linearize_report["history"] == report["history"]
    # Hub-ready: weights, code, tokenizer, card with the recipe, and it loads as a causal LM
    from transformers import AutoModelForCausalLM

    out = tmp_path / "whole"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    card = (out / "README.md").read_text()
    assert "attention transfer" in card and "per-layer loss after" in card
    assert json.loads((out / "linearize_report.json").read_text())["recipe"]["steps"] == 6
    again = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ids = torch.randint(2, V, (1, 8), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(again(ids).logits, whole(ids).logits, rtol=0, atol=0)
    # a resume with other settings is refused, naming them
    with pytest.raises(ValueError, match="learning_rate"):
        linearize(folder, tmp_path / "parts", resume_from_checkpoint=str(next((tmp_path / "parts").glob("step_*"))),
                  **{**kw, "learning_rate": 1e-3})


def test_bad_arguments_are_refused(source, tmp_path):
    folder, text = source
    with pytest.raises(ValueError, match="exactly one source of text"):
        linearize(folder, tmp_path / "x", feature_map="elu", train="attention", block_size=16)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        linearize(folder, tmp_path / "x", train_files=[str(text)], steps=0)
    with pytest.raises(ValueError, match="does not exist"):
        linearize(folder, tmp_path / "x", train_files=[str(tmp_path / "nope.txt")], feature_map="elu", train="attention",
                  block_size=16)


def test_command_line(source, tmp_path, capsys):
    from hf_kernattn.cli import main

    folder, text = source
    code = main(["-q", "linearize", str(folder), str(tmp_path / "cli"), "--train_file", str(text), "--feature_map", "elu",
                 "--train", "attention", "--steps", "2", "--batch_size", "2", "--block_size", "8"])
    assert code == 0
    assert "saved to" in capsys.readouterr().out
    assert main(["linearize", str(folder), str(tmp_path / "bad"), "--steps", "2", "--block_size", "16"]) == 1
    assert "exactly one source of text" in capsys.readouterr().err


def test_default_recipe_trains_only_the_learned_feature_maps(source, tmp_path):
    folder, text = source
    model = linearize(folder, tmp_path / "hh", train_files=[str(text)], steps=8, batch_size=4, block_size=16,
                      progress=False)
    report = model.linearize_report
    assert model.config.feature_map == "hedgehog"
    assert report["trained_parameters"] and all(n.endswith(("feature_map.query_weight", "feature_map.key_weight"))
                                                for n in report["trained_parameters"])
    assert sum(report["layer_loss_after"]) < sum(report["layer_loss_before"])
    # everything else is the copied source weight
    from hf_kernattn.convert import convert

    fresh = convert(folder, None, feature_map="hedgehog")
    trained = set(report["trained_parameters"])
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b) != (name in trained), name
