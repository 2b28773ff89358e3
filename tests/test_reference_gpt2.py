"""The reference GPT-2 (reference_impls/gpt2.py) against transformers' GPT2LMHeadModel, fp32 CPU.

The zoo's gpt2-abspos has learned absolute position embeddings, so a left-padded row is right only
if its positions count real tokens (pads excluded): checked against each prompt alone.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config  # noqa: E402

from conftest import assert_matches_oracle  # noqa: E402
from pytest_kvcompile.contract.engine import ModelSpec  # noqa: E402
from pytest_kvcompile.models import zoo  # noqa: E402
from pytest_kvcompile.recompiles.recorder import CompileRecorder  # noqa: E402
from reference_impls.compile import left_pad  # noqa: E402
from reference_impls.compiled_dynamic import CompiledDynamicCache  # noqa: E402
from reference_impls.loader import load_model  # noqa: E402

ATOL = 1e-4


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def spec_for(path) -> ModelSpec:
    return ModelSpec("gpt2-abspos", path, AutoConfig.from_pretrained(path))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> ModelSpec:
    return spec_for(zoo.checkpoint("gpt2-abspos", tmp_path_factory.mktemp("zoo")))


@pytest.fixture(scope="module")
def hf(gpt2):
    return AutoModelForCausalLM.from_pretrained(gpt2.path, attn_implementation="eager").eval()


@torch.inference_mode()
def ref_logits(model, prompts: list[list[int]], feed: torch.Tensor) -> torch.Tensor:
    """[b, 1 + steps, vocab]: the left-padded prefill's last logits, then one row per column of feed [b, steps]
    fed through the cache."""
    tokens, valid = left_pad(prompts, "cpu")
    logits, cache = model(tokens, valid)
    rows = [logits]
    for column in feed.T:
        valid = torch.cat((valid, valid.new_ones(len(prompts), 1)), dim=1)
        logits, cache = model(column[:, None], valid, cache)
        rows.append(logits)
    return torch.stack(rows, dim=1)


@torch.inference_mode()
def hf_alone(hf, p: list[int], feed: list[int]) -> torch.Tensor:
    """transformers' logits [1 + len(feed), vocab] at p's last position and each fed token's, one full forward."""
    return hf(torch.tensor([p + feed])).logits[0, len(p) - 1:]


@pytest.mark.parametrize("length", [1, 2, 7, 33, 200])
def test_alone_equals_transformers(gpt2, hf, length):
    model, p, feed = load_model(gpt2), prompt(length, length), prompt(4, 100 + length)
    torch.testing.assert_close(ref_logits(model, [p], torch.tensor([feed]))[0], hf_alone(hf, p, feed),
                               atol=ATOL, rtol=ATOL)


def test_left_padded_batch_equals_transformers(gpt2, hf):
    """Each row equals its prompt alone; transformers' own padded batch agrees when given positions that
    count real tokens, and differs without them (GPT-2's positions are absolute)."""
    model, lengths = load_model(gpt2), (9, 1, 33, 5)
    prompts, feeds = [prompt(n, n) for n in lengths], [prompt(3, 50 + n) for n in lengths]
    got = ref_logits(model, prompts, torch.tensor(feeds))
    for row, p, feed in zip(got, prompts, feeds):
        torch.testing.assert_close(row, hf_alone(hf, p, feed), atol=ATOL, rtol=ATOL)
    tokens, valid = left_pad(prompts, "cpu")
    with torch.inference_mode():
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        padded = hf(tokens, attention_mask=valid.long(), position_ids=positions).logits[:, -1]
        pads_counted = hf(tokens, attention_mask=valid.long()).logits[:, -1]
    torch.testing.assert_close(got[:, 0], padded, atol=ATOL, rtol=ATOL)
    assert not torch.allclose(got[1:, 0], pads_counted[1:], atol=ATOL)  # rows 1-3 are padded


def test_tied_head(tmp_path):
    """A tied checkpoint has no lm_head.weight: the head is wte (`GPT2.tied_embedding`)."""
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=None,
                        eos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    p, feed = prompt(9, 1), prompt(3, 2)
    torch.testing.assert_close(ref_logits(load_model(spec_for(tmp_path)), [p], torch.tensor([feed]))[0],
                               hf_alone(hf, p, feed), atol=ATOL, rtol=ATOL)


def test_engine_tokens_and_two_compiles(gpt2, hf):
    """ref-compiled-dynamic on GPT-2: the oracle's greedy tokens, batched and alone; two compiles, then none."""

    @torch.no_grad()
    def oracle(p, n):
        out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                          output_logits=True)
        return out.sequences[0, len(p):].tolist(), torch.cat(out.logits)

    with CompileRecorder() as rec:
        engine = CompiledDynamicCache(gpt2, compile_backend="aot_eager")
        engine.generate([[5]], 2)
        rec.mark_warmup_done()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for lengths in ((7,), (33, 1, 9, 2), (1, 200)):
                prompts = [prompt(n, 7 * n) for n in lengths]
                for p, got in zip(prompts, engine.generate(prompts, 8)):
                    assert_matches_oracle(oracle, p, got)
    assert [e.frame.split(" ")[0] for e in rec.warmup_events] == ["prefill", "decode"]
    assert rec.post_warmup_events == [], "\n".join(e.describe() for e in rec.post_warmup_events)
