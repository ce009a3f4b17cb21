"""A Hugging Face model, unmodified, trained through a run against the real Redis and S3.

A tiny GPT-2 built from a config (nothing is downloaded) is wrapped as it is in a `Learner` with
AdamW; an in-process coordinator merges its contributions. What a user of `transformers` relies
on: its `transformer.h.<i>` blocks are planned as units, the tied embedding / LM head is one
parameter in the run (and still tied after merging new versions into it), and training goes
through genesis, contributions and adopted versions with a finite loss. And taking the model out:
`diloco model export` in each format, loaded back by `transformers` (`from_pretrained`), safetensors
and torch, `diloco.load_global` and `Learner.global_state_dict`, all equal to the committed versions.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from diloco.coordinator.config import CoordinatorConfig, RunSettings  # noqa: E402
from diloco.coordinator.policy import RoundConfig  # noqa: E402
from diloco.coordinator.service import Coordinator  # noqa: E402
from diloco import load_global  # noqa: E402
from diloco.infra.cli import main as diloco  # noqa: E402
from diloco.storage.global_model import read_global  # noqa: E402
from diloco.storage.history import read_layout, read_manifest  # noqa: E402
from diloco.workers.learner import Learner  # noqa: E402
from harness import serving  # noqa: E402

MIN_STEPS = 40
ADOPT_DEADLINE_S = 60.0
BATCH, SEQ = 8, 32


def tiny_gpt2() -> torch.nn.Module:
    # bos/eos inside the tiny vocabulary: the default 50256 only makes transformers warn.
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow  # a Hugging Face GPT-2 through a run: 20 s
def test_unmodified_gpt2_trains_through_the_run_and_its_model_comes_out(endpoints, run_id, tmp_path, monkeypatch):
    coord = Coordinator(endpoints, run_id,
                        settings=RunSettings(num_fragments=2, sync_every=4, overlap_steps=1, cadence="steps"),
                        config=CoordinatorConfig(round=RoundConfig(min_quorum=1, max_grace_s=0.0)))
    torch.manual_seed(0)
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    learner = Learner(model, opt, run=run_id, endpoints=endpoints, learner_id="gpt2", tokens_per_step=BATCH * SEQ)
    data = torch.Generator().manual_seed(1)
    losses: list[float] = []
    with serving(coord), learner:
        deadline = time.monotonic() + ADOPT_DEADLINE_S
        # At least MIN_STEPS, then on until every fragment has taken a version beyond 0 (or time is up).
        while learner.step < MIN_STEPS or (min(learner.versions.values()) < 1 and time.monotonic() < deadline):
            tokens = torch.randint(0, 64, (BATCH, SEQ), generator=data)
            loss = model(input_ids=tokens, labels=tokens).loss
            learner.report(loss=loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())

    layout = read_layout(coord.store, coord.keys)
    fragment_of = {p.name: f for f, params in enumerate(layout.fragments) for p in params}
    # Each transformer block is one unit, and the two equal blocks are strided over the two fragments.
    block_fragments = [{f for name, f in fragment_of.items() if name.startswith(f"transformer.h.{i}.")}
                       for i in range(2)]
    assert [len(fs) for fs in block_fragments] == [1, 1], block_fragments
    assert block_fragments[0] != block_fragments[1]
    # The tied embedding / LM head is one parameter in the run, and merging kept the tie.
    names = [p.name for params in layout.fragments for p in params]
    assert names.count("transformer.wte.weight") == 1 and "lm_head.weight" not in names
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert model.lm_head.weight is model.transformer.wte.weight

    heads = coord.bus.heads()
    assert min(heads.values()) >= 1, heads
    assert min(learner.versions.values()) >= 1, learner.versions
    assert learner.adopted >= 2 and learner.stats.upload_failed == 0
    # Every take followed a send by at least overlap_steps (1) steps trained on, and the heartbeat says so.
    assert learner.steps_through >= learner.adopted and learner.progress().steps_through == learner.steps_through
    assert all(math.isfinite(x) for x in losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert coord.bus.counters().get("contributions_refused", 0) == 0, coord.bus.refusals()

    # ---- the model out -----------------------------------------------------------------------
    committed = read_global(coord.store, coord.keys)  # each fragment's newest version, sha256-checked
    assert committed.versions == tuple(heads[f] for f in range(2))
    for f, version in enumerate(committed.versions):
        assert committed.params_sha256[f] == read_manifest(coord.store, coord.keys, f, version).params_sha256
    expected = {n: t for n, t in committed.state.items()}
    assert sorted(learner.global_state_dict()) == sorted(expected)
    assert all(torch.equal(learner.global_state_dict()[n], t) for n, t in expected.items())

    for name, value in endpoints.to_env().items():
        monkeypatch.setenv(name, value)
    model.config.save_pretrained(tmp_path / "config")
    for fmt in ("hf", "safetensors", "torch"):
        argv = ["model", "export", "--run", run_id, "--out", str(tmp_path / fmt), "--format", fmt]
        assert diloco(argv + (["--hf-config", str(tmp_path / "config")] if fmt == "hf" else [])) == 0, fmt
    # A Hugging Face checkpoint: from_pretrained gives the global model, embedding and head still tied.
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert all(torch.equal(dict(loaded.named_parameters())[n], t) for n, t in expected.items())
    from safetensors.torch import load_file
    assert {n: t for n, t in load_file(tmp_path / "safetensors" / "model.safetensors").items()}.keys() == expected.keys()
    assert all(torch.equal(load_file(tmp_path / "safetensors" / "model.safetensors")[n], t) for n, t in expected.items())
    state = torch.load(tmp_path / "torch" / "model.pt", weights_only=True)
    assert all(torch.equal(state[n], t) for n, t in expected.items())
    # diloco.load_global loads the same into a fresh model of the same shape, in place.
    fresh = tiny_gpt2()
    assert load_global(run_id, fresh, endpoints=endpoints).versions == committed.versions
    assert all(torch.equal(dict(fresh.named_parameters())[n], t) for n, t in expected.items())
