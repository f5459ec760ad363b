"""The per-example signals that come with the features (clusterlm.selection.signals): each example's gradient norm
(its feature before normalisation) and its answer-token loss, from the same forward pass.

Against a float64 reference on a tiny model (every feature preset, with a feature window); kept in the feature store
(shards, ``signals.npy``, checksums) through a killed and resumed featurization and a sharded (distributed) one; in
the plan (plan.npz) and back; a plan or a store without them still loads. (Not ``test_signals.py``: that basename is
tests/reliability's, and pytest imports test files by basename.)
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from cluster_kernels.projection import random_projection
from clusterlm.config.comparison import method_config, parse_method
from clusterlm.plan import Plan
from clusterlm.selection.distributed import featurize_sharded
from clusterlm.selection.features import GradientFeaturizer, feature_window
from clusterlm.selection.select import select, select_from_features
from clusterlm.selection.signals import ExampleSignals
from clusterlm.selection.store import FeatureStore

REPO = Path(__file__).resolve().parents[2]
VOCAB = 53


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def examples(n: int, seed: int = 0, lengths: tuple[int, int] = (4, 20)) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(*lengths))
        ids = rng.integers(0, VOCAB, t)
        labels = ids.copy()
        labels[: max(1, t // 3)] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def reference(model: torch.nn.Module, feat: GradientFeaturizer, data: list[dict], window: int | None) -> np.ndarray:
    """(N, 2) float64 gradient norm and loss of each example: a float64 copy of the model, one example at a time,
    cut to its feature window, the gradient by autograd and projected in float64 (the paper proxy: its formula)."""
    m64 = copy.deepcopy(model).double().eval()
    head = m64.get_output_embeddings()
    head_name = next(n for n, mod in m64.named_modules() if mod is head)
    modules = dict(m64.named_modules())
    names = feat.layer_names
    rows = []
    for ex in data:
        ids, labels = np.asarray(ex["input_ids"]), np.asarray(ex["labels"])
        if window is not None:
            lo, hi = feature_window(labels, window)
            ids, labels = ids[lo:hi], labels[lo:hi]
        captured = {}
        hook = head.register_forward_pre_hook(lambda mod, a, c=captured: c.__setitem__("h", a[0]))
        m64(input_ids=torch.tensor(ids)[None])
        hook.remove()
        h = captured["h"][0]
        w_head = head.weight.detach().clone().requires_grad_(True)
        logits = h @ w_head.T
        y = torch.tensor(labels)[1:]
        loss = F.cross_entropy(logits[:-1], y, ignore_index=-100)
        if feat.mode == "paper":
            keep = y != -100
            p_y = torch.softmax(logits[:-1][keep], -1)[torch.arange(int(keep.sum())), y[keep]]
            vec = ((p_y - 1)[:, None] * h[:-1][keep]).mean(0).detach()
        else:
            params = [w_head if n == head_name else modules[n].weight for n in names]
            vec = torch.zeros(feat.k_o, feat.k_i, dtype=torch.float64)
            for name, grad in zip(names, torch.autograd.grad(loss, params), strict=True):
                p_in = random_projection(grad.shape[1], feat.k_i, seed=feat.seed, name=f"{name}/in",
                                         dtype=torch.float64)
                p_out = random_projection(grad.shape[0], feat.k_o, seed=feat.seed, name=f"{name}/out",
                                          dtype=torch.float64)
                vec += p_out.T @ grad @ p_in
        rows.append([float(vec.detach().norm()), float(loss.detach())])
    return np.asarray(rows)


@pytest.mark.parametrize(("features", "window"), [("lm_head", 8), ("all-linear", 8), ("paper", None)])
def test_stored_norms_and_losses_equal_a_float64_reference(features, window, tmp_path):
    model, data = tiny_llama(), examples(9)
    kwargs = {} if features == "paper" else {"dim": (4, 3)}
    feat = GradientFeaturizer(model, features=features, feature_tokens=window, seed=2, **kwargs)
    feats, signals = feat.featurize(data, batch_tokens=40, store=FeatureStore(tmp_path, shard_size=4),
                                    progress=False, return_signals=True)
    want = reference(model, feat, data, window)
    np.testing.assert_allclose(signals.grad_norm, want[:, 0], rtol=2e-5)
    np.testing.assert_allclose(signals.loss, want[:, 1], rtol=2e-5)
    # the features K-means sees are unchanged: unit rows (the projected presets), whatever their norm
    if features != "paper":
        np.testing.assert_allclose(np.linalg.norm(np.asarray(feats, dtype=np.float64), axis=1), 1.0, rtol=1e-5)
    # in memory: the same signals (the windows and batches are the same)
    _, in_memory = feat.featurize(data, batch_tokens=40, shard_size=4, progress=False, return_signals=True)
    np.testing.assert_array_equal(in_memory.as_array(), signals.as_array())
    # on disk: signals.npy beside features.npy, its blocks checksummed in the records
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert all("signals_sha256" in r for r in manifest["shards"].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["features.npy", "manifest.json", "signals.npy"]


# A causal LM of plain torch (a killed child starts in seconds without transformers) and the data of the kill test:
# one source for the child and this process.
TINY_LM = textwrap.dedent(
    """
    import numpy as np, torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self, vocab=41, hidden=8):
            super().__init__()
            self.embed, self.mix = nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            h = torch.tanh(self.mix(self.embed(input_ids)))
            h = torch.cumsum(h, dim=1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[:, None]
            return self.lm_head(h)

    def kill_test_data():
        rng = np.random.default_rng(3)
        out = []
        for _ in range(14):
            t = int(rng.integers(4, 16))
            ids = rng.integers(0, 41, t)
            labels = ids.copy()
            labels[: t // 3] = -100
            out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
        return out
    """
)
_tiny: dict = {}
exec(TINY_LM, _tiny)  # noqa: S102 - this file's own source, shared with the child

CHILD = TINY_LM + textwrap.dedent(
    """
    import os, signal, sys
    torch.set_num_threads(1)
    from clusterlm.selection.features import GradientFeaturizer
    from clusterlm.selection.store import FeatureStore

    original = FeatureStore._write_signals_shard
    def write_then_die(self, index, signals, rows):
        sha = original(self, index, signals, rows)
        if index == 2:  # shard 2's signals are on disk, its features and record are not
            os.kill(os.getpid(), signal.SIGKILL)
        return sha
    FeatureStore._write_signals_shard = write_then_die
    feat = GradientFeaturizer(TinyLM(), features="lm_head", dim=(4, 2), feature_tokens=8)
    feat.featurize(kill_test_data(), store=FeatureStore(sys.argv[1], shard_size=3), batch_tokens=30, progress=False)
    """
)


def test_signals_survive_a_killed_and_resumed_featurization(tmp_path, monkeypatch):
    killed, fresh = tmp_path / "killed", tmp_path / "fresh"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "python_api"),
                                                       os.environ.get("PYTHONPATH", "")]))
    child = subprocess.run([sys.executable, "-c", CHILD, str(killed)], env=env, timeout=300)
    assert child.returncode == -9
    manifest = json.loads((killed / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["0", "1"] and not manifest["complete"]
    assert (killed / "shard_00002.signals.npy").is_file() and not (killed / "shard_00002.npy").exists()
    before = [np.load(killed / f"shard_0000{i}.signals.npy") for i in (0, 1)]
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # as the child: the same floating-point sums
    try:
        feat = GradientFeaturizer(_tiny["TinyLM"](), features="lm_head", dim=(4, 2), feature_tokens=8)
        calls, run_batch = [], GradientFeaturizer._run_batch

        def counted(self, batch):
            calls.append(len(batch))
            return run_batch(self, batch)

        monkeypatch.setattr(GradientFeaturizer, "_run_batch", counted)
        data = _tiny["kill_test_data"]()
        _, resumed = feat.featurize(data, store=FeatureStore(killed, shard_size=3), batch_tokens=30,
                                    progress=False, return_signals=True)
        assert sum(calls) == 14 - 6  # shards 0 and 1 were kept, 2 (signals only) and the rest recomputed
        _, again = feat.featurize(data, store=FeatureStore(fresh, shard_size=3), batch_tokens=30,
                                  progress=False, return_signals=True)
    finally:
        torch.set_num_threads(saved)
    np.testing.assert_array_equal(resumed.as_array()[:6], np.concatenate(before))  # the killed run's, as stored
    np.testing.assert_allclose(resumed.as_array(), again.as_array(), rtol=1e-6)
    assert FeatureStore(killed).signals().as_array().tobytes() == resumed.as_array().tobytes()


def test_a_damaged_signals_block_is_dropped_with_its_features_and_recomputed(tmp_path):
    feat = GradientFeaturizer(tiny_llama(), features="lm_head", dim=(2, 2))
    data = examples(7)
    _, good = feat.featurize(data, store=FeatureStore(tmp_path, shard_size=3), progress=False, return_signals=True)
    arr = np.load(tmp_path / "signals.npy")
    arr[4, 1] += 1.0  # a bit flip in shard 1's loss
    np.save(tmp_path / "signals.npy", arr)
    with pytest.raises(ValueError, match=r"rows 3..5 \(shard 1\) \(signals.npy\) does not match its checksum"):
        FeatureStore(tmp_path).signals()
    assert sorted(json.loads((tmp_path / "manifest.json").read_text())["shards"]) == ["0", "2"]
    _, again = feat.featurize(data, store=FeatureStore(tmp_path, shard_size=3), progress=False, return_signals=True)
    np.testing.assert_array_equal(again.as_array(), good.as_array())


def test_sharded_featurization_keeps_the_signals_of_every_rank(tmp_path):
    feat = GradientFeaturizer(_tiny["TinyLM"](), features="all-linear", dim=(3, 3), feature_tokens=8)
    data = _tiny["kill_test_data"]()[:11]
    parts = [featurize_sharded(feat, data, tmp_path / "s", rank=r, world_size=3, shard_size=2, progress=False)
             for r in range(3)]
    parts[2].finalize()
    _, single = feat.featurize(data, shard_size=2, progress=False, return_signals=True)
    np.testing.assert_array_equal(FeatureStore(tmp_path / "s").signals().as_array(), single.as_array())


def test_a_store_without_signals_reads_and_a_signal_pick_on_it_names_the_fix(tmp_path):
    model, data = tiny_llama(), examples(12)
    feat = GradientFeaturizer(model, features="lm_head", dim=(2, 2))
    feats = feat.featurize(data, store=FeatureStore(tmp_path, shard_size=4), progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for rec in manifest["shards"].values():  # as an older clusterlm wrote it
        rec.pop("signals_sha256")
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "signals.npy").unlink()
    store = FeatureStore(tmp_path)
    assert store.signals() is None
    np.testing.assert_array_equal(store.features(), feats)
    config = method_config(parse_method("cluster[within_cluster=loss,feature_tokens=all]"), 2, 0.5, 0)
    with pytest.raises(ValueError, match=r"within_cluster='loss' ranks by each example's loss, which the feature "
                                         r"store .* does not hold"):
        select(model, data, config.replace(dim=(2, 2)), feature_store=FeatureStore(tmp_path, shard_size=4),
               progress=False, model_id="m")


def test_select_keeps_the_signals_in_the_plan_and_its_files(tmp_path):
    model, data = tiny_llama(), examples(24, lengths=(6, 30))
    plan, feats = select(model, data, world_size=2, ratio=0.25, within_cluster="rank-farthest-loss", dim=(3, 3),
                         progress=False, model_id="tiny", return_features=True)
    featurizer = GradientFeaturizer(model, features="lm_head", dim=(3, 3), feature_tokens=64)
    _, signals = featurizer.featurize(data, progress=False, return_signals=True)
    np.testing.assert_array_equal(plan.losses, signals.loss)
    np.testing.assert_array_equal(plan.grad_norms, signals.grad_norm)
    plan.save(tmp_path / "p")
    with np.load(tmp_path / "p" / "plan.npz") as npz:
        assert {"grad_norms", "losses"} <= set(npz.files)
    back = Plan.load(tmp_path / "p")
    np.testing.assert_array_equal(back.losses, plan.losses)
    np.testing.assert_array_equal(back.grad_norms, plan.grad_norms)
    assert "selected mean loss" in back.summary()
    # a plan without them (made without features, or before they were kept) saves and loads as before
    bare = select_from_features(np.asarray(feats), world_size=2, ratio=0.25, lengths=np.full(24, 10))
    bare.save(tmp_path / "bare")
    with np.load(tmp_path / "bare" / "plan.npz") as npz:
        assert "losses" not in npz.files
    assert Plan.load(tmp_path / "bare").losses is None


def test_a_plan_refuses_signals_of_another_length_or_from_another_save(tmp_path):
    x = np.random.default_rng(0).standard_normal((30, 4)).astype(np.float32)
    sig = ExampleSignals(np.arange(30.0), np.linspace(1, 2, 30))
    plan = select_from_features(x, world_size=2, ratio=0.3, lengths=np.full(30, 5), signals=sig)
    fields = {k: getattr(plan, k) for k in plan.__dataclass_fields__}
    with pytest.raises(ValueError, match=r"Plan.losses: expected shape \(30,\) like weights, or None"):
        Plan(**{**fields, "losses": np.zeros(3)})
    with pytest.raises(ValueError, match=r"Plan.grad_norms: must be finite and >= 0"):
        Plan(**{**fields, "grad_norms": -np.ones(30)})
    plan.save(tmp_path)
    with np.load(tmp_path / "plan.npz") as npz:
        arrays = {k: npz[k] for k in npz.files if k != "losses"}
    np.savez(tmp_path / "plan.npz", **arrays)  # plan.npz of a save without them
    meta = json.loads((tmp_path / "plan.json").read_text())
    meta["arrays"]["sha256"] = hashlib.sha256((tmp_path / "plan.npz").read_bytes()).hexdigest()  # the arrays tell
    (tmp_path / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"arrays 'losses' differ from those saved with"):
        Plan.load(tmp_path)


def test_compare_takes_the_new_picks_as_method_variants():
    for pick in ("grad-norm", "loss", "rank-farthest-loss", "rank-farthest-grad-norm", "alternate-loss-farthest"):
        spec = parse_method(f"cluster[within_cluster={pick}]")
        assert method_config(spec, 2, 0.31, 0).within_cluster == pick
    with pytest.raises(ValueError, match="within_cluster"):
        parse_method("cluster-paper[within_cluster=loss]")


def test_compare_times_a_selection_only_once_the_processes_it_launched_are_gone():
    """(compare's timing, issue item 6) A process this one launched (its environment names this process in
    CLUSTERLM_LAUNCHER_PID, as every process of a launch does) is waited for; others are not."""
    from clusterlm.comparison.settle import launched_processes, wait_for_launched
    from clusterlm.launch.environment import LAUNCHER_PID_ENV

    ours = subprocess.Popen(["sleep", "0.6"], env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())})
    other = subprocess.Popen(["sleep", "5"], env={**os.environ, LAUNCHER_PID_ENV: "1"})
    try:
        if not Path("/proc/self/environ").exists():
            pytest.skip("no /proc: nothing is waited for")
        found = launched_processes()  # (with any other test's leftovers of this process)
        assert ours.pid in found and other.pid not in found
        waited = wait_for_launched(timeout=10)
        assert ours.pid not in launched_processes() and other.poll() is None and waited > 0.1
    finally:
        other.kill()
        other.wait()
        ours.wait()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["projected", "paper"])
def test_the_vocabulary_pass_gives_each_examples_mean_loss(backend, mode):
    """cluster_kernels.lm_head_features(losses=...): the mean cross-entropy of each example's counted tokens, from the
    pass that computes the features (the Triton kernel runs in the interpreter without a GPU)."""
    from cluster_kernels._backend import has_triton
    from cluster_kernels.lm_head_features import lm_head_features

    if backend == "triton" and not has_triton():
        pytest.skip("no Triton")
    g = torch.Generator().manual_seed(0)
    h, weight = torch.randn(11, 16, generator=g), torch.randn(37, 16, generator=g)
    labels = torch.randint(0, 37, (11,), generator=g)
    labels[[0, 4, 5]] = -100
    cu = torch.tensor([0, 3, 7, 11])
    proj = {} if mode == "paper" else {"p_in": torch.randn(16, 4, generator=g),
                                       "p_out": torch.randn(37, 3, generator=g)}
    losses = torch.full((3,), -1.0, dtype=torch.float64)
    lm_head_features(h, weight, labels, cu, mode=mode, backend=backend, losses=losses, **proj)
    nll = F.cross_entropy(h.double() @ weight.double().T, labels.clamp_min(0), reduction="none")
    keep = labels != -100
    want = [float(nll[a:b][keep[a:b]].mean()) for a, b in ((0, 3), (3, 7), (7, 11))]
    np.testing.assert_allclose(losses.numpy(), want, rtol=1e-5)
    with pytest.raises(ValueError, match=r"losses must be a floating \(3,\) tensor"):
        lm_head_features(h, weight, labels, cu, mode=mode, losses=torch.zeros(2), **proj)
