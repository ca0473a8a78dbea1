"""Each producer named by evidence and audited by its own rules: a plain ``dcp.save``, torch
FSDP1, torchtitan, Lightning, the Hugging Face Trainer, accelerate (committed fixtures from
``tests/fixtures/producers/generate.py``, each the library's own save)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import inspector
from inspector.errors import InspectorError
from inspector.formats import producers
from inspector.ui.cli import main
from inspector.ui.views import findings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "producers"


def expected(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    facts = json.loads((FIXTURES / f"{name}.expected.json").read_text())
    return load_file(FIXTURES / f"{name}.expected.safetensors"), facts


def assert_tensors(ck: inspector.Checkpoint, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor the library's own reader returned, bit for bit, under the same key."""
    for key, value in tensors.items():
        got = ck.read(key)
        assert got.dtype == value.dtype and torch.equal(got, value), key


def kinds(report: inspector.AuditReport) -> list[str]:
    return [p.kind for p in report.problems]


# --- the profiles --------------------------------------------------------------------------
def test_every_profile_is_named_once_and_evidence_is_specific() -> None:
    assert tuple(dict.fromkeys(producers.NAMES)) == producers.NAMES
    assert set(producers.NAMES) == {
        "torchtitan", "torch-dcp", "megatron-core", "deepspeed", "hf-trainer", "lightning",
        "accelerate", "torch_checkpointing", "unknown",
    }  # fmt: skip
    for p in producers.PROFILES:
        assert set(p.resume) <= set(p.components) or not p.components, p.name
    found, why = producers.identify([], [("model", "w"), ("train_state", "step")])
    assert found is producers.UNKNOWN and why.startswith("producer: unknown")
    found, why = producers.identify([], [("dataloader", "dp_rank_3")])
    assert found is producers.TORCHTITAN and "'dataloader.dp_rank_3'" in why
    assert producers.identify(["trainer_state.json"], [])[0] is producers.HF_TRAINER
    assert producers.identify(["optimizer_0/"], [])[0] is producers.ACCELERATE
    assert producers.profile("no such producer") is producers.UNKNOWN


# --- plain torch DCP -----------------------------------------------------------------------
@pytest.fixture(scope="session")
def plain_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the torch docs show: ``get_state_dict`` then ``dcp.save`` of model, optimizer and
    a train state (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    path = tmp_path_factory.mktemp("plain") / "ckpt"
    state = {"model": msd, "optimizer": osd, "train_state": {"step": 1000}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    return path


def test_plain_dcp_save_is_torch_dcp_and_audits_clean(plain_dcp: Path, capsys) -> None:
    ck = inspector.open(plain_dcp)
    assert (ck.producer, ck.layout) == ("torch-dcp", "prefixed")
    report = inspector.audit(ck)
    assert report.ok and report.problems == ()
    assert main(["audit", str(plain_dcp)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("(dcp): OK")
    everything = findings.at_once(ck)
    assert everything.producer.title == "written by torch-dcp"
    layout = everything.layout.finding()
    assert layout.tone == "ok" and "torchtitan" not in layout.title + layout.consequence
    assert "PR #1347" not in ck.layout_reason


def test_unknown_producer_missing_optimizer_is_a_note(plain_dcp: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.ones(2)}, "lr_scheduler": {"last_epoch": 3}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "c"), no_dist=True)
    report = inspector.audit(tmp_path / "c")
    assert report.ok and kinds(report) == ["absent-component"]
    assert report.problems[0].severity == "info"
    assert "no optimizer state beside model, lr_scheduler" in report.problems[0].message


# --- torchtitan ----------------------------------------------------------------------------
def test_torchtitan_by_its_training_state(demo_dir: Path) -> None:
    flat, prefixed, seed = (inspector.open(demo_dir / n) for n in ("flat", "prefixed", "seed"))
    assert (flat.producer, prefixed.producer) == ("torchtitan", "torchtitan")
    assert any("from key 'dataloader.dp_rank_" in n for n in flat.source.notes)
    assert seed.producer == "torch-dcp"  # model weights alone are no evidence
    assert "PR #1347" in prefixed.layout_reason
    assert findings.at_once(prefixed).layout.finding().tone == "warn"


def test_torchtitan_missing_components_are_errors(tmp_path: Path) -> None:
    """torchtitan's training state without its scheduler: torchtitan always saves one."""
    import torch.distributed.checkpoint as dcp

    state = {
        "w": torch.ones(2),
        "optimizer": {"state.w.step": torch.tensor(1.0)},
        "dataloader": {"dp_rank_0": b"x"},
        "train_state": {"step": 1, "ntokens_seen": 5},
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "t"), no_dist=True)
    report = inspector.audit(tmp_path / "t")
    assert inspector.open(tmp_path / "t").producer == "torchtitan"
    assert kinds(report) == ["missing-component"] and not report.ok
    assert "torchtitan saves it and a resume loads it" in report.problems[0].message


# --- torch FSDP1 SHARDED_STATE_DICT --------------------------------------------------------
def test_fsdp1_sharded_state_dict() -> None:
    ck = inspector.open(FIXTURES / "fsdp1")
    tensors, _ = expected("fsdp1")
    assert ck.producer == "torch-dcp"
    assert_tensors(ck, {k: v for k, v in tensors.items() if k in set(ck.keys())})
    assert {k for k in tensors if k.startswith("model.")} <= set(ck.keys())
    assert inspector.audit(ck).ok


# --- Lightning -----------------------------------------------------------------------------
def test_lightning_ckpt() -> None:
    ck = inspector.open(FIXTURES / "lightning" / "model.ckpt")
    tensors, facts = expected("lightning")
    assert ck.producer == "lightning"
    assert set(ck.keys()) == set(tensors) | set(facts["objects"])
    assert_tensors(ck, tensors)
    assert ck.read_object("hyper_parameters.lr") == 0.01  # through the AttributeDict
    assert list(ck.components()) == ["model", "optimizer", "lr_scheduler", "loops", "callbacks",
                                     "other"]  # fmt: skip
    report = inspector.audit(ck)
    assert report.ok and report.problems == ()
    assert ck.layout == "prefixed" and "Lightning saves" in ck.layout_reason
    layout = findings.at_once(ck).layout.finding()
    assert layout.tone == "ok" and "torchtitan" not in layout.title + layout.consequence


def test_lightning_damaged_record_names_file_and_key(tmp_path: Path) -> None:
    import zipfile

    source = FIXTURES / "lightning" / "model.ckpt"
    with zipfile.ZipFile(source) as z:
        data = [(i, z.read(i)) for i in z.infolist()]
    victim = next(i.filename for i, _ in data if i.filename.endswith("/data/0"))
    damaged = tmp_path / "model.ckpt"
    with zipfile.ZipFile(damaged, "w", zipfile.ZIP_STORED) as z:
        for info, blob in data:
            z.writestr(info, blob[:2] if info.filename == victim else blob)
    ck = inspector.open(damaged)
    bad = [e.key for e in ck.entries() if e.error]
    assert len(bad) == 1
    with pytest.raises(InspectorError) as caught:
        ck.read(bad[0])
    assert caught.value.file and "model.ckpt" in caught.value.file
    assert caught.value.key == bad[0]
    others = [e.key for e in ck.entries() if e.kind == "tensor" and not e.error]
    assert others and all(ck.read(k).numel() >= 0 for k in others)


# --- Hugging Face Trainer ------------------------------------------------------------------
def test_hf_trainer_checkpoint_folder() -> None:
    run = inspector.open(FIXTURES / "hf-trainer")
    ck = inspector.open(FIXTURES / "hf-trainer" / "checkpoint-2")
    tensors, facts = expected("hf-trainer")
    assert (ck.producer, run.producer) == ("hf-trainer", "hf-trainer")
    alone = inspector.open(FIXTURES / "hf-trainer" / "checkpoint-2" / "model.safetensors")
    assert alone.producer == "unknown"  # the model file alone names no trainer
    assert [s.name for s in run.steps] == ["checkpoint-2"]
    assert set(ck.keys()) == set(tensors) | set(facts["objects"])
    assert_tensors(ck, tensors)
    components = ck.components()
    assert {"model", "optimizer", "lr_scheduler", "rng", "train_state"} <= set(components)
    assert all(e.component == "rng" for e in ck.entries() if e.key.startswith("rng_state."))
    assert ck.read_object("trainer_state.global_step") == 2
    weights = [e.key for e in ck.entries() if e.component == "model"]
    assert weights and not any(k.startswith(("rng_state", "optimizer")) for k in weights)
    report = inspector.audit(ck)
    assert report.ok and not [p for p in report.problems if p.severity != "info"]


def test_hf_trainer_export_holds_the_weights_only(tmp_path: Path) -> None:
    """The export of a Trainer step is its model file's tensors, not its RNG or optimizer."""
    step = FIXTURES / "hf-trainer" / "checkpoint-2"
    inspector.export(step, tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    want = load_file(step / "model.safetensors")
    assert sorted(written) == sorted(want)
    assert all(torch.equal(written[k], v) for k, v in want.items())


def test_hf_trainer_format_hf_equals_the_trainers_model_file(tmp_path: Path) -> None:
    """``format="hf"`` on a Trainer step of a Llama (HF names already, config.json beside):
    the Trainer's own model.safetensors, bit for bit; optimizer and trainer state left out."""
    step = Path(__file__).resolve().parents[1] / "fixtures" / "hf_trainer" / "run" / "checkpoint-6"
    result = inspector.export(step, tmp_path / "hf", format="hf", progress=False)
    written = load_file(tmp_path / "hf" / "model.safetensors")
    want = load_file(step / "model.safetensors")
    assert sorted(written) == sorted(want)
    assert all(
        torch.equal(written[k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items()
    )
    assert any(k.startswith("optimizer.") for k in result.skipped)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["model_type"] == "llama"


# --- accelerate ----------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["plain", "fsdp"])
def test_accelerate_save_state(form: str) -> None:
    ck = inspector.open(FIXTURES / "accelerate" / form)
    tensors, facts = expected(f"accelerate-{form}")
    assert ck.producer == "accelerate"
    assert set(ck.keys()) == set(tensors) | set(facts["objects"])
    assert_tensors(ck, tensors)
    assert {"model", "optimizer", "lr_scheduler", "rng"} <= set(ck.components())
    report = inspector.audit(ck)
    assert report.ok and not [p for p in report.problems if p.severity != "info"], report


def test_accelerate_folder_missing_a_part(tmp_path: Path) -> None:
    folder = shutil.copytree(FIXTURES / "accelerate" / "fsdp", tmp_path / "fsdp")
    shutil.rmtree(folder / "optimizer_0")
    report = inspector.audit(folder)
    assert kinds(report) == ["missing-component"]
    assert "no optimizer state" in report.problems[0].message
    (folder / "pytorch_model_fsdp_0" / ".metadata").unlink()
    ck = inspector.open(folder)
    (broken,) = [e for e in ck.entries() if e.error]
    assert broken.key == "pytorch_model_fsdp_0/" and ".metadata" in broken.error
    assert ck.read_object("scheduler.last_epoch") == 2  # the rest stays browsable


# --- Megatron-Core -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tp1", "tp2"])
def test_megatron_optimizer_keys_spelled_its_way(name: str) -> None:
    """``optimizer.state.exp_avg.<fqn>``: the state's name first, and no per-parameter step
    (its profile): every parameter's state is found, none is an orphan."""
    from inspector.analysis.resume import optimizer_state
    from inspector.keys.spellings import model_fqn

    ck = inspector.open(FIXTURES.parent / "megatron" / name)
    assert ck.producer == "megatron-core"
    params = {f for e in ck.entries() if e.kind == "tensor" and (f := model_fqn(e))}
    found = optimizer_state(ck.entries(), params, ck.profile)
    assert not found.unknown and len(found.states) == 9
    assert all(set(s) == {"exp_avg", "exp_avg_sq"} for s in found.states.values())
    report = inspector.audit(ck, checksums=False)
    assert report.ok and report.problems == ()


# --- torch_checkpointing -------------------------------------------------------------------
def test_torch_checkpointing_audits_clean(tc_single_written: dict) -> None:
    ck = inspector.open(tc_single_written["single"].path)
    assert ck.producer == "torch_checkpointing"
    report = inspector.audit(ck)
    assert report.ok and not [p for p in report.problems if p.severity != "info"], report


def test_a_torch_save_training_dict_is_not_blamed_on_torchtitan(tmp_path: Path) -> None:
    """``torch.save({"model": ..., "optimizer": ...})``: no producer named, the nesting is
    explained, nothing about torchtitan's history."""
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.save({"model": model.state_dict(), "optimizer": optim.state_dict()}, tmp_path / "c.pt")
    ck = inspector.open(tmp_path / "c.pt")
    assert (ck.producer, ck.layout) == ("unknown", "prefixed")
    line = findings.layout_facts(ck).finding()
    assert line.tone == "ok" and "ckpt['model']" in line.consequence
    assert "torchtitan" not in line.title + line.consequence + ck.layout_reason
    assert inspector.audit(ck).ok
