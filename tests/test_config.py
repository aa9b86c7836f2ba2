"""Config files load, typos and bad values are refused by name, the token is resolved.

Like zeroband's ``tests/test_configs.py``: every config file shipped in the
repository is loaded here, so a renamed field cannot leave a stale example behind.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from ds_diloco import cli
from ds_diloco.config import (
    TOKEN_ENV,
    CoordinatorConfig,
    DataConfig,
    IslandConfig,
    ModelSource,
    TrainConfig,
    from_dict,
    learner_steps_at,
    load_coordinator_config,
    load_island_config,
    load_run_config,
)
from ds_diloco.hf_model import build_model
from ds_diloco.merge import StalenessPolicy
from ds_diloco.outer_optim import OuterOptimConfig
from ds_diloco.round_policy import PolicyOptions

REPO = Path(__file__).resolve().parent.parent
MODEL_CONFIGS = sorted((REPO / "model_configs").glob("*.json"))
DEEPSPEED_CONFIGS = sorted((REPO / "model_configs" / "deepspeed").glob("*.json"))
MODEL_README = REPO / "model_configs" / "README.md"
SIZE_IN_NAME = re.compile(r"-(\d+)([mb])$")  # llama-125m.json: meant to have 125M parameters
SIZED_CONFIGS = [p for p in MODEL_CONFIGS if SIZE_IN_NAME.search(p.stem)]
ALL_LAUNCH_YAML = sorted((REPO / "launch").rglob("*.yaml"))
# Run files (ds-diloco run) have islands; the others are coordinator configs.
RUN_FILES = [p for p in ALL_LAUNCH_YAML if "islands" in yaml.safe_load(p.read_text())]
# Island configs (ds-diloco island) name their island.
ISLAND_FILES = [p for p in ALL_LAUNCH_YAML if "island" in yaml.safe_load(p.read_text())]
# Fault schedules (ds-diloco chaos --schedule) list events.
SCHEDULE_FILES = [p for p in ALL_LAUNCH_YAML if "events" in yaml.safe_load(p.read_text())]
LAUNCH_CONFIGS = [p for p in ALL_LAUNCH_YAML if p not in RUN_FILES + ISLAND_FILES + SCHEDULE_FILES]
BUILD_LIMIT = 20_000_000  # parameters: larger configs are only counted, not built
TINY = REPO / "model_configs" / "tiny-llama.json"  # vocab_size 4096
ZERO3_CPU = REPO / "model_configs" / "deepspeed" / "zero3_cpu.json"

MINIMAL = {"model": {"config": "/models/m.json"}, "state_dir": "/state"}


def with_changes(base: dict, changes: dict) -> dict:
    """``base`` with dotted keys set (``{"policy.tau": 3}``); a value of ... deletes."""
    data = json.loads(json.dumps(base))
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        if value is ...:
            node.pop(last, None)
        else:
            node[last] = value
    return data


def write_yaml(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def stand_in(path: Path, root: Path, replace: dict[str, str] | None = None) -> Path:
    """Launch file ``path`` at the same place under ``root``, a stand-in for the repository
    (launch/ copied, model_configs/ linked), so that its relative paths resolve as there;
    ``replace``: text replaced in the copy (a cluster's absolute paths)."""
    if not (root / "launch").exists():
        shutil.copytree(REPO / "launch", root / "launch")
        (root / "model_configs").symlink_to(REPO / "model_configs")
    copy = root / path.relative_to(REPO)
    text = copy.read_text()
    for old, new in (replace or {}).items():
        text = text.replace(old, new)
    copy.write_text(text)
    return copy


def load_shipped_island(path: Path, tmp_path: Path):
    """An island file whose tokenizer is a cluster's path (/data/...): refused here, where it
    does not exist, and loaded with a folder under ``tmp_path`` in its place."""
    tokenizer = yaml.safe_load(path.read_text())["data"].get("tokenizer")
    if tokenizer is None or (path.parent / tokenizer).is_dir():
        return load_island_config(path)
    with pytest.raises(
        ValueError, match=rf"data.tokenizer '{re.escape(tokenizer)}' is not a folder"
    ):
        load_island_config(path)
    stand = tmp_path / f"tokenizer-{path.stem}"
    stand.mkdir()
    return load_island_config(stand_in(path, tmp_path / "repo", {tokenizer: str(stand)}))


# --------------------------------------------------------------- shipped files
def test_the_repository_ships_configs():
    assert MODEL_CONFIGS, "model_configs/ holds no *.json"
    assert LAUNCH_CONFIGS, "launch/ holds no *.yaml"
    assert {p.name for p in DEEPSPEED_CONFIGS} >= {
        "zero3_cpu.json",
        "zero3_gpu.json",
        "zero3_gpu_offload.json",
    }
    assert {p.name for p in SIZED_CONFIGS} >= {
        "llama-125m.json",
        "llama-1b.json",
        "llama-7b.json",
    }


def count_params(config) -> int:
    """Parameters of the model ``config`` builds, counted on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.name)
def test_model_config_loads_and_builds(path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = AutoConfig.from_pretrained(str(path))
    assert config.model_type == json.loads(path.read_text())["model_type"]
    n_params = count_params(config)
    assert n_params > 0
    if n_params > BUILD_LIMIT:
        return
    model = build_model(ModelSource(config=str(path), seed=0))
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("path", SIZED_CONFIGS, ids=lambda p: p.name)
def test_model_size_matches_its_name_and_the_readme(path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = AutoConfig.from_pretrained(str(path))
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    n_params = count_params(config)
    number, unit = SIZE_IN_NAME.search(path.stem).groups()
    meant = int(number) * {"m": 10**6, "b": 10**9}[unit]
    assert abs(n_params - meant) <= 0.1 * meant, f"{path.name}: {n_params:,} parameters"
    rows = [r for r in MODEL_README.read_text().splitlines() if r.startswith(f"| `{path.name}` |")]
    assert len(rows) == 1, f"model_configs/README.md needs one table row for {path.name}"
    assert f"| {n_params:,} |" in rows[0], f"README row says {rows[0]!r}, counted {n_params:,}"


def test_the_readme_lists_every_config():
    text = MODEL_README.read_text()
    for path in MODEL_CONFIGS:
        assert f"| `{path.name}` |" in text
    for path in DEEPSPEED_CONFIGS:
        assert f"| `deepspeed/{path.name}` |" in text


def deepspeed_keys() -> set[str]:
    """Every config key DeepSpeed names: it ignores unknown top-level keys, so a
    misspelt one would silently fall back to a default."""
    import deepspeed.runtime.constants
    import deepspeed.runtime.zero.config

    modules = (deepspeed.runtime.constants, deepspeed.runtime.zero.config)
    return {v for m in modules for v in vars(m).values() if isinstance(v, str)}


@pytest.fixture
def deepspeed_on_cpu(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=lambda p: p.name)
def test_deepspeed_config_is_accepted_by_deepspeed(path, deepspeed_on_cpu):
    raw = json.loads(path.read_text())
    assert raw["zero_optimization"]["stage"] == 3
    unknown = sorted(set(raw) - deepspeed_keys())
    assert not unknown, f"{path.name}: keys DeepSpeed does not know: {unknown}"
    assert "optimizer" not in raw, "the island's inner optimizer is its own torch AdamW"
    # The island fills the batch sizes from its train section (ds_diloco.island).
    filled = {**raw, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    # Outside a distributed world DeepSpeedConfig takes world size 1 (rank 0).
    cfg = deepspeed_on_cpu(filled)
    assert cfg.zero_enabled and cfg.zero_optimization_stage == 3
    assert cfg.train_batch_size == 4 * cfg.world_size
    assert cfg.gradient_clipping == 1.0
    if cfg.zero_config.offload_optimizer is not None:
        # Otherwise deepspeed.initialize refuses the island's client torch AdamW.
        assert cfg.zero_force_ds_cpu_optimizer is False
    # The sub-configs are strict: a misspelt zero_optimization key is refused.
    typo = json.loads(json.dumps(filled))
    typo["zero_optimization"]["stage3_param_persistance_threshold"] = 0
    with pytest.raises(ValueError, match="stage3_param_persistance_threshold"):
        deepspeed_on_cpu(typo)
    with pytest.raises(TypeError):  # the placeholder must be replaced before use
        deepspeed_on_cpu({**filled, "train_micro_batch_size_per_gpu": "auto"})


def test_cpu_deepspeed_config_runs_on_cpu(deepspeed_on_cpu):
    """What the CPU runs need (shared/reference/deepspeed-on-cpu.md)."""
    raw = json.loads((REPO / "model_configs" / "deepspeed" / "zero3_cpu.json").read_text())
    cfg = deepspeed_on_cpu(
        {**raw, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    )
    assert not cfg.bfloat16_config.enabled and not cfg.float16_config.enabled  # fp32
    assert cfg.zero_config.param_persistence_threshold == 0  # tiny models really partition
    assert cfg.zero_force_ds_cpu_optimizer is False
    assert cfg.zero_config.offload_param is None and cfg.zero_config.offload_optimizer is None


@pytest.mark.parametrize("name", ["zero3_gpu.json", "zero3_gpu_offload.json"])
def test_gpu_deepspeed_configs_train_in_bf16(name, deepspeed_on_cpu):
    raw = json.loads((REPO / "model_configs" / "deepspeed" / name).read_text())
    cfg = deepspeed_on_cpu(
        {**raw, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    )
    assert cfg.bfloat16_config.enabled and not cfg.float16_config.enabled
    assert cfg.zero_config.overlap_comm and cfg.zero_config.contiguous_gradients
    offload = [cfg.zero_config.offload_param, cfg.zero_config.offload_optimizer]
    if name == "zero3_gpu_offload.json":
        assert all(o is not None and o.device == "cpu" and o.pin_memory for o in offload)
    else:
        assert offload == [None, None]


@pytest.mark.parametrize("path", SCHEDULE_FILES, ids=lambda p: p.name)
def test_launch_fault_schedule_loads_and_fits_its_run_file(path):
    from ds_diloco.chaos.schedule import Schedule

    schedule = Schedule.from_file(path)
    assert len(schedule) > 0
    run = load_run_config(path.parent / "chaos.yaml")
    schedule.check_targets({s.name: s.world_size for s in run.islands})


@pytest.mark.parametrize("path", LAUNCH_CONFIGS, ids=lambda p: p.name)
def test_launch_config_loads_with_paths_relative_to_the_file(path, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the working directory must not matter
    cfg = load_coordinator_config(path)
    raw = yaml.safe_load(path.read_text())
    raw = raw.get("coordinator", raw)
    for key in ("pretrained", "config"):
        value = getattr(cfg.model, key)
        if value is not None:
            assert Path(value).is_absolute()
            assert Path(value).resolve() == (path.parent / raw["model"][key]).resolve()
            assert Path(value).exists(), f"{path.name}: model.{key} {value} does not exist"
    assert Path(cfg.state_dir).is_absolute()
    assert Path(cfg.state_dir).resolve() == (path.parent / raw["state_dir"]).resolve()


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: p.name)
def test_run_files_load_with_paths_relative_to_the_file(path, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    root = REPO
    pretrained = yaml.safe_load(path.read_text())["model"].get("pretrained")
    if pretrained and not (path.parent / pretrained).is_dir():
        # Made by the run's launch script (convert-gguf) before it runs the file: refused
        # until then, saying how to make it; a stand-in repository holds an empty one.
        with pytest.raises(
            ValueError, match=r"model.pretrained '.+' is not a folder.*convert-gguf"
        ):
            load_run_config(path)
        root = tmp_path / "repo"
        path = stand_in(path, root)
        (path.parent / pretrained).mkdir(parents=True)
        (path.parent / pretrained / "config.json").write_text('{"model_type": "llama"}')
    cfg = load_run_config(path)
    model = Path(cfg.model.config or cfg.model.pretrained)
    # A pretrained folder under .cache/ is made by the run's launch script (convert-gguf);
    # it must be where that script writes it. Every other model path must exist.
    cache = (root / ".cache").resolve()
    if cache in model.resolve().parents:
        script = (path.parent / f"{path.stem.split('-')[0]}.sh").read_text()
        assert model.resolve().relative_to(root.resolve()).as_posix() in script, script
    else:
        assert model.exists()
    assert Path(cfg.deepspeed_config).is_file()
    assert json.loads(Path(cfg.deepspeed_config).read_text())["zero_optimization"]["stage"] == 3
    assert Path(cfg.workdir).is_absolute()
    # The coordinator takes the run's model and keeps its state under the workdir.
    assert cfg.coordinator.model == cfg.model
    assert Path(cfg.coordinator.state_dir) == Path(cfg.workdir) / "state"
    assert cfg.islands and all(i.world_size >= 1 for i in cfg.islands)


@pytest.mark.parametrize("path", ISLAND_FILES, ids=lambda p: p.name)
def test_island_files_load_with_paths_relative_to_the_file(path, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = load_shipped_island(path, tmp_path)
    assert Path(cfg.model.config or cfg.model.pretrained).exists()
    assert Path(cfg.deepspeed_config).is_file()
    assert cfg.coordinator_url.startswith("http")
    assert 0 <= cfg.shard < cfg.num_shards


def test_multinode_islands_take_disjoint_shards(tmp_path):
    cfgs = [load_shipped_island(p, tmp_path) for p in ISLAND_FILES if "multinode" in str(p)]
    assert len(cfgs) == 2
    assert {c.shard for c in cfgs} == {0, 1} and {c.island for c in cfgs} == {"a", "b"}
    assert all(c.num_shards == 2 for c in cfgs)


@pytest.mark.parametrize("path", [p for p in ISLAND_FILES if "multinode" in str(p)], ids=str)
def test_a_multinode_island_files_comments_name_its_own_island_and_files(path, tmp_path):
    island = load_shipped_island(path, tmp_path).island
    header = "".join(line for line in path.read_text().splitlines(True) if line.startswith("#"))
    assert f'# Island "{island}":' in header, header
    names = re.findall(r"launch/multinode/(\S+)", header)
    assert names == [f"hostfile-island-{island}", path.name], names
    assert all((path.parent / name).is_file() for name in names)


MULTINODE_README = REPO / "launch" / "multinode" / "README.md"


def test_the_multinode_readmes_commands_parse_and_name_files_of_the_repository():
    """Every ``ds-diloco`` command of the README (run from the repository, as the launcher's
    is) takes its flags, and the files it names are there."""
    spans = re.findall(r"`((?:ds-diloco|deepspeed) [^`]+)`", MULTINODE_README.read_text())
    # Whole commands, not a name in the text ('`ds-diloco export --from` take ...').
    commands = [c for c in spans if len(c.split()) > 2 and not c.split()[-1].startswith("-")]
    assert len(commands) == 6, commands
    for command in commands:
        words = command.split()
        for flag, value in itertools.pairwise(words):
            if flag in ("--config", "--data", "--hostfile"):
                assert (REPO / value).is_file(), f"{command}: {value} is no file of the repository"
        if words[0] == "deepspeed":  # its script's own arguments after --module's module
            words = ["ds-diloco", *words[words.index("ds_diloco.cli") + 1 :]]
        cli.build_parser().parse_args(words[1:])


def launcher_command(args: list[str], env_file: Path, monkeypatch) -> str:
    """What the deepspeed launcher runs on an island's nodes over ssh (pdsh) for ``args``
    (a ``deepspeed`` command line), started in the repository with ``env_file`` as its
    ``.deepspeed_env``; nothing is run."""
    import signal
    import subprocess

    import deepspeed.launcher.runner as runner

    pdsh = env_file.parent / "bin" / "pdsh"  # the launcher looks for it on PATH
    pdsh.parent.mkdir(exist_ok=True)
    pdsh.write_text("#!/bin/sh\n")
    pdsh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{pdsh.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(runner, "DEEPSPEED_ENVIRONMENT_PATHS", [str(env_file.parent)])
    monkeypatch.setattr(runner, "DEEPSPEED_ENVIRONMENT_NAME", env_file.name)
    monkeypatch.chdir(REPO)
    commands = []

    class Started:
        returncode = 0

        def __init__(self, cmd, env=None):
            commands.append(" ".join(cmd))

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "check_call", lambda *a, **k: 0)  # its ssh check
    monkeypatch.setattr(subprocess, "Popen", Started)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # its handlers: not in pytest
    runner.main(args)
    assert len(commands) == 1 and commands[0].startswith("pdsh "), commands
    return commands[0]


def test_multinode_ranks_get_the_token_the_way_the_readme_says(tmp_path, monkeypatch):
    """The launcher starts an island's ranks over ssh with none of the shell's variables but
    a few prefixes' (NCCL, PYTHON, ...) and the lines of ``.deepspeed_env``: the token
    exported in the shell reaches no rank (each failed: no token), the README's way does."""
    text = MULTINODE_README.read_text()
    command = re.search(r"On node-a1: `deepspeed ([^`]+)`", text).group(1).split()
    assert command[command.index("--hostfile") + 1] == "launch/multinode/hostfile-island-a"
    monkeypatch.setenv(TOKEN_ENV, "exported")
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text("GLOO_SOCKET_IFNAME=eth0\n")
    ran = launcher_command(command, env_file, monkeypatch)
    assert "-w node-a1,node-a2 " in ran and "--master_addr=node-a1 " in ran
    assert ran.endswith("--module --enable_each_rank_log=None ds_diloco.cli island --config "
                        "launch/multinode/island-a.yaml")  # fmt: skip
    assert "export GLOO_SOCKET_IFNAME=eth0;" in ran and TOKEN_ENV not in ran
    # The README's line in .deepspeed_env, its placeholder filled in.
    line = re.search(rf"`({TOKEN_ENV}=<[^`>]+>)` in `\.deepspeed_env`", text)
    assert line, f"{MULTINODE_README.name} does not say to put {TOKEN_ENV}=... in .deepspeed_env"
    env_file.write_text(re.sub(r"<.+>", "s3cret", line.group(1)) + "\n")
    assert f"export {TOKEN_ENV}=s3cret;" in launcher_command(command, env_file, monkeypatch)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")
def test_the_multinode_readmes_https_steps_done_as_written_load(tmp_path, monkeypatch):
    """The README's certificate command, run where its other commands run (the repository),
    and the settings it gives: the coordinator and the islands load, and the --ca-file it
    names is there. Before, it wrote coord.pem into the working directory and said
    `tls_cert: coord.pem`, which the file resolves beside itself: "tls_cert
    '.../launch/multinode/coord.pem' does not exist"."""
    import subprocess

    text = MULTINODE_README.read_text()
    section = text[text.index("Islands in other datacenters") :]
    openssl = re.search(r"```bash\n(openssl [^\n]+)\n```", section).group(1)
    root = tmp_path / "repo"
    coord = stand_in(REPO / "launch/multinode/coordinator.yaml", root)
    load_shipped_island(REPO / "launch/multinode/island-a.yaml", tmp_path)  # its tokenizer here
    island_file = root / "launch/multinode/island-a.yaml"
    # The cluster's folder (/data/ds_diloco) stands in under tmp_path, in the command too.
    data = tmp_path / "data"
    data.mkdir()
    fill = {"/data/ds_diloco": str(data)}

    def filled(s: str) -> str:
        for old, new in fill.items():
            s = s.replace(old, new)
        return s

    monkeypatch.chdir(root)
    subprocess.run(filled(openssl), shell=True, check=True, capture_output=True)
    settings = dict(re.findall(r"`(tls_cert|tls_key|coordinator_ca): ([^`]+)`", section))
    assert set(settings) == {"tls_cert", "tls_key", "coordinator_ca"}, settings
    text = coord.read_text().replace("state_dir: /data/ds_diloco/", f"state_dir: {data}/")
    text += "".join(f"{k}: {filled(settings[k])}\n" for k in ("tls_cert", "tls_key"))
    coord.write_text(text)
    cfg = load_coordinator_config(coord)
    assert cfg.tls_cert and Path(cfg.tls_cert).is_file()
    text = island_file.read_text().replace("http://coordinator-host", "https://coordinator-host")
    text += f"coordinator_ca: {filled(settings['coordinator_ca'])}\n"
    island_file.write_text(text)
    assert load_island_config(island_file).coordinator_ca
    ca_file = re.search(r"take `--ca-file ([^`]+)`", section).group(1)
    assert Path(filled(ca_file)).is_file(), ca_file  # from the working directory


NAN, INF = float("nan"), float("inf")
# A run file whose paths all exist (data.path "t" is made beside it).
RUN = {"model": {"config": str(TINY)}, "deepspeed_config": str(ZERO3_CPU), "data": {"path": "t"},
       "islands": [{"name": "a"}], "coordinator": {"num_fragments": 4, "sync_every": 4}}  # fmt: skip
BAD_NAMES = ["", "../x", "a/b", "a b", "a?b", "x" * 129, ".", "..", "a\nb"]


def write_run(tmp_path: Path, changes: dict) -> Path:
    (tmp_path / "t").mkdir(parents=True, exist_ok=True)  # the corpus, resolved like workdir
    return write_yaml(tmp_path / "run.yaml", with_changes(RUN, changes))


def test_an_islands_train_section_overrides_the_runs_for_it_alone(tmp_path):
    run = load_run_config(write_run(tmp_path / "conf", {
        "train": {"steps": 50, "micro_batch": 4, "lr": 0.01, "freeze": ["embed"]},
        "islands": [{"name": "big", "world_size": 2, "train": {"micro_batch": 16, "grad_accum": 2}},
                    {"name": "small"}],
    }))  # fmt: skip
    big, small = (run.train_of(s) for s in run.islands)
    assert (big.micro_batch, big.grad_accum, big.lr, big.steps, big.freeze) == (
        16,
        2,
        0.01,
        50,
        ("embed",),
    )
    assert small == run.train and small.micro_batch == 4 and small.grad_accum == 1


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"islands": []}, "at least one island"),
        ({"islands": [{"name": "a"}, {"name": "a"}]}, "unique"),
        ({"islands": [{"name": "a", "world_size": 0}]}, "world_size"),
        ({"coordinator.num_fragment": 3}, "coordinator.num_fragment"),
        ({"train.steps": 0}, "train.steps"),
        ({"data.seq_len": 1}, "^data.seq_len must be >= 2"),  # named once, not 'data: data.'
        ({"coordinator.norm_guard.max_ratio": 0.5}, "^coordinator.norm_guard: NormGuard.max_ratio"),
        ({"coordinator.norm_guard": {"max_ratio": 5, "min_history": 40}}, "min_history"),
        ({"workdir": "t/runs/one"}, r"workdir '\S+/t/runs/one' is inside data.path '\S+/t'"),
        ({"workdir": "t"}, "inside data.path"),
        # The coordinator's model is the run's: resolved like it, and refused if it differs.
        ({"coordinator.model": {"config": "other.json"}},
         r"coordinator.model \{config: '\S*other.json', seed: 0\} differs from model "
         r"\{config: '\S+tiny-llama.json', seed: 0\}"),
        ({"coordinator.model": {"config": str(TINY), "seed": 1}}, "coordinator.model .* differs"),
        # Files the islands open are checked at load, not in every rank later.
        ({"model": {"pretrained": "nowhere"}},
         r"model.pretrained 'nowhere' is not a folder .* converted to one with `ds-diloco convert-gguf`"),
        ({"model": {"pretrained": "../smollm2-135m"}},
         r"model.pretrained '\S+' is not a folder .*`ds-diloco convert-gguf --smollm2 --out /\S+/smollm2-135m`"),
        ({"data.tokenizer": "./tok"}, r"data.tokenizer '\S+/tok' is not a folder"),
        ({"data.vocab_size": 8192}, r"data.vocab_size \(8192\) is above the vocab_size of "
                                    r"model.config '\S+/tiny-llama.json' \(4096\)"),
        ({"deepspeed_config": "ds.json"}, r"deepspeed_config '/\S+/ds.json' does not exist"),
        # Numbers: NaN passes every comparison, inf is no duration, a port is 16 bits.
        ({"train.lr": NAN}, r"train.lr must be > 0 and finite, got nan"),
        ({"train.lr": INF}, r"train.lr must be > 0 and finite, got inf"),
        ({"train.weight_decay": NAN}, r"train.weight_decay must be >= 0 and finite, got nan"),
        ({"train.weight_decay": -0.1}, r"train.weight_decay must be >= 0 and finite, got -0.1"),
        ({"train.step_delay_s": NAN}, r"train.step_delay_s must be >= 0 and finite, got nan"),
        ({"train.step_delay_s": INF}, r"train.step_delay_s must be >= 0 and finite, got inf"),
        ({"train.seed": -1}, r"train.seed must be >= 0, got -1"),
        ({"train.stall_exit_s": -5}, r"train.stall_exit_s must be >= 0 \(0: never\) and finite, got -5"),
        ({"islands": [{"name": "a", "train": {"stall_exit_s": INF}}]}, r"train.stall_exit_s must be >= 0 \(0: never\) and finite, got inf"),
        ({"train.activation_checkpointing": -1}, r"train.activation_checkpointing must be >= 0 \(0: off, N: every N-th layer\), got -1"),
        ({"train.startup_stall_s": -1}, r"train.startup_stall_s must be >= 0 \(0: never\) and finite, got -1"),
        ({"islands": [{"name": "a", "train": {"startup_stall_s": INF}}]}, r"train.startup_stall_s must be >= 0 \(0: never\) and finite, got inf"),
        ({"train.grad_accum": 0}, r"train.grad_accum must be >= 1, got 0"),
        ({"islands": [{"name": "a", "train": {"grad_accum": 0}}]}, r"train.grad_accum must be >= 1, got 0"),
        ({"islands": [{"name": "a", "train": {"micro_batchs": 8}}]}, r"unknown key\(s\) 'islands.train.micro_batchs'"),
        # An island's own lr (3e-4) is what its min_lr is checked against, not the run's.
        ({"islands": [{"name": "a", "train": {"lr": 3e-4, "lr_schedule": "cosine", "min_lr": 5e-4}}]},
         r"train.min_lr must be in \[0, train.lr = 0.0003\], got 0.0005"),
        ({"train.lr_schedule": "linear"}, r"train.lr_schedule must be one of constant, cosine, got 'linear'"),
        ({"train.min_lr": 0.01}, r"train.min_lr must be in \[0, train.lr = 0.001\], got 0.01"),
        ({"train.min_lr": NAN}, r"train.min_lr must be in \[0, train.lr = 0.001\], got nan"),
        ({"data.seed": -1}, r"data.seed must be >= 0, got -1"),
        ({"data.prepare_timeout_s": 0}, r"data.prepare_timeout_s must be > 0 and finite, got 0"),
        ({"data.prepare_timeout_s": INF}, r"data.prepare_timeout_s must be > 0 and finite, got inf"),
        ({"train.convert_timeout_s": INF}, r"train.convert_timeout_s must be > 0 and finite, got inf"),
        ({"train.convert_timeout_s": 0}, r"train.convert_timeout_s must be > 0 and finite, got 0"),
        ({"restart_backoff_s": NAN}, r"restart_backoff_s must be >= 0 \(and finite\), got 5 and nan"),
        ({"coordinator_hang_s": -1}, r"coordinator_hang_s must be >= 0 \(0: never\) and finite, got -1"),
        ({"downscale_after": -1}, r"downscale_after and slot_quarantine_s must be >= 0 \(and finite\), got -1 and 1800.0"),
        ({"slot_quarantine_s": INF}, r"downscale_after and slot_quarantine_s must be >= 0 \(and finite\), got 2 and inf"),
        ({"coordinator_hang_s": NAN}, r"coordinator_hang_s must be >= 0 \(0: never\) and finite, got nan"),
        ({"coordinator.max_body_mb": NAN}, r"^coordinator: max_body_mb must be > 0 and finite, got nan"),
        ({"coordinator.max_body_mb": INF}, r"coordinator: max_body_mb must be > 0 and finite, got inf"),
        ({"coordinator.island_timeout_s": NAN}, r"coordinator: island_timeout_s must be > 0 and finite"),
        ({"coordinator.uptime_window_s": NAN}, r"coordinator: uptime_window_s must be > 0 and finite"),
        ({"coordinator.stall_exit_s": -1}, r"coordinator: stall_exit_s must be >= 0 \(0: never\)"),
        ({"coordinator.stall_exit_s": INF}, r"coordinator: stall_exit_s must be >= 0 \(0: never\) and finite, got inf"),
        ({"coordinator.port": 70000}, r"coordinator: port must be in 0..65535, got 70000"),
        ({"coordinator.port": -1}, r"coordinator: port must be in 0..65535, got -1"),
        ({"coordinator.plain_patterns": ["embed", "[bad"]}, r"plain_patterns: '\[bad' is not a regex"),
        ({"train.freeze": ["embed", "[bad"]}, r"train.freeze: '\[bad' is not a regex"),
        ({"islands": [{"name": "a", "master_port": 65536}]}, r"islands\[a\].master_port must be in 0..65535"),
        # Ports and launcher slots: two islands on one port, or a world_size the launcher
        # does not start, would fail (or run a different job) only at launch.
        ({"islands": [{"name": "a", "master_port": 29500}, {"name": "b", "master_port": 29500}]},
         r"islands\[b\].master_port 29500 is also islands\[a\].master_port"),
        ({"coordinator.port": 29500, "islands": [{"name": "a", "master_port": 29500}]},
         r"islands\[a\].master_port 29500 is also coordinator.port"),
        ({"islands": [{"name": "a", "include": "localhost:0,1"}]},
         r"islands\[a\].include 'localhost:0,1' lists 2 slot\(s\) but world_size is 1"),
        ({"islands": [{"name": "a", "world_size": 3, "include": "h1:0@h2:0,1,2"}]},
         r"lists 4 slot\(s\) but world_size is 3"),
        ({"islands": [{"name": "a", "include": "localhost:x"}]},
         r"islands\[a\].include: slots must be integers, got 'localhost:x'"),
        ({"islands": [{"name": "a", "include": "localhost:"}]}, r"slots must be integers"),
        ({"islands": [{"name": "a", "include": ":0"}]},
         r"islands\[a\].include: expected 'host:slot,slot\[@host:slot,...\]' with each host once"),
        ({"islands": [{"name": "a", "include": ""}]}, r"include: expected 'host:slot"),
        ({"islands": [{"name": "a", "include": "h:0:1"}]}, r"include: expected 'host:slot"),
        ({"islands": [{"name": "a", "world_size": 2, "include": "h:0@h:1"}]}, "each host once"),
        ({"islands": [{"name": "a", "world_size": 2, "include": "h:0,0"}]},
         r"slots must be distinct and >= 0, got 'h:0,0'"),
        ({"islands": [{"name": "a", "include": "h:-1"}]}, "distinct and >= 0"),
        # What is missing or mistyped is named.
        ({"model": ...}, r"^model: missing"),
        ({"model": None}, r"^model: expected a mapping, got NoneType"),
        ({"workdir": 5}, r"^workdir: expected str, got 5"),
        ({"workdir": None}, r"^workdir: expected str, got None"),
        ({"workdir": ["a"]}, r"^workdir: expected str, got \['a'\]"),
        # A nested section's rule names where the section is.
        ({"coordinator.outer.momentum": 1.0},
         r"^coordinator.outer: OuterOptimConfig.momentum must be in \[0, 1\)"),
        ({"coordinator.policy.tau": 0}, r"^coordinator.policy: PolicyOptions.tau must be >= 1"),
        ({"coordinator.sync_every": 0}, r"^coordinator: sync_every must be >= 1, got 0"),
        ({"coordinator.sync_every": -8}, r"^coordinator: sync_every must be >= 1, got -8"),
        ({"coordinator.num_fragments": 0}, r"^coordinator: num_fragments must be >= 1, got 0"),
        ({"coordinator.compression": {"name": "int4", "residual": "float16"}},
         r"^coordinator.compression: codec residual: must be 'float32' or 'bfloat16'"),
        # An empty path is no path: taken for the working directory, a fresh run cleared
        # its state/, islands/, export/ and tensorboard/ folders.
        ({"workdir": ""}, r"^workdir: an empty path"),
        ({"data.path": ""}, r"^data.path: an empty path"),
        ({"coordinator.state_dir": ""}, r"^coordinator.state_dir: an empty path"),
        ({"model": {"config": ""}}, r"^model.config: an empty path"),
        ({"workdir": "../ds.json"}, r"^workdir '\S+ds.json' is a file, not a folder"),
        ({"coordinator.state_dir": "../ds.json"}, r"^coordinator.state_dir '\S+' is a file"),
        ({"data.cache_dir": "../ds.json"}, r"^data.cache_dir '\S+ds.json' is a file, not a fo"),
        ({"push_to_hub": ""}, r"^push_to_hub: empty"),
        # What the islands load, at load, not in a transformers traceback in every rank.
        ({"model": {"config": "./tiny-lama.json"}}, r"^model.config '\S+tiny-lama.json' does n"),
        ({"model": {"config": "../ds.json"}}, r"^model.config: '\S+ds.json' is not a Hugging"),
        ({"model": {"pretrained": "."}}, r"^model.pretrained '\S+' holds no config.json"),
    ]
    + [({"islands": [{"name": n}]}, r"^islands\[\].name must be 1-128 of") for n in BAD_NAMES],
)  # fmt: skip
def test_run_file_errors_name_the_problem(tmp_path, monkeypatch, changes, message):
    if "restart_backoff_s" in changes:
        changes = {**changes, "max_restarts": 5}
    monkeypatch.chdir(tmp_path)  # a relative deepspeed_config found here would not count
    (tmp_path / "ds.json").write_text(ZERO3_CPU.read_text())
    with pytest.raises(ValueError, match=message):
        load_run_config(write_run(tmp_path / "conf", changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"workdir": "runs/one"},  # beside the corpus, or in a folder whose name only
        {"workdir": "t2/run"},  # starts like it, is fine
        {"workdir": "../t"},
        {"coordinator.model": {"config": str(TINY)}},  # the run's own model, said again
        {"coordinator.model": {"config": str(TINY.parent / "deepspeed" / ".." / TINY.name)}},
        {"data.vocab_size": 4096, "train.lr": 1e-3, "train.weight_decay": 0, "data.seed": 0},
        {"coordinator.port": 8470,
         "islands": [{"name": "a", "master_port": 29500}, {"name": "b", "master_port": 0},
                     {"name": "c", "master_port": 0}]},
        {"islands": [{"name": "a", "world_size": 2, "include": "localhost:0,1"},
                     {"name": "b", "world_size": 3, "include": "h1:2@h2:0,1"},
                     # every slot of a host (the hostfile's): not counted here
                     {"name": "c", "world_size": 2, "include": "localhost"},
                     {"name": "d", "world_size": 9, "include": "h1:0@h2"}]},
        {"islands": [{"name": "A-z.0_9"}, {"name": "x" * 128}, {"name": "..."}]},
        {"model": {"pretrained": "pre"}, "data.vocab_size": 8192},  # not a config: no vocab check
        {"data.tokenizer": "tok", "data.vocab_size": 8192},  # vocab_size is the tokenizer's
        {"coordinator.compression": {"name": "int4", "residual": "bfloat16"}},
    ],
)  # fmt: skip
def test_run_files_that_load(tmp_path, changes):
    for folder in ("pre", "tok"):
        (tmp_path / folder).mkdir()
    (tmp_path / "pre" / "config.json").write_text('{"model_type": "llama"}')  # a model folder
    cfg = load_run_config(write_run(tmp_path, changes))
    assert cfg.coordinator.model == cfg.model
    if "workdir" in changes:
        assert cfg.workdir.endswith(changes["workdir"].lstrip("./"))
    if "coordinator.compression" in changes:
        assert cfg.coordinator.compression.residual == "bfloat16"


def test_run_coordinator_model_resolves_against_the_run_file(tmp_path, monkeypatch):
    (tmp_path / "conf" / "sub").mkdir(parents=True)
    shutil.copy(TINY, tmp_path / "conf" / "sub" / "m.json")
    monkeypatch.chdir(tmp_path)  # not the run file's folder: 'sub/m.json' is not here
    model = {"config": "sub/m.json"}
    cfg = load_run_config(
        write_run(tmp_path / "conf", {"model": model, "coordinator.model": model})
    )
    assert cfg.coordinator.model.config == str(tmp_path / "conf" / "sub" / "m.json")
    assert cfg.coordinator.model == cfg.model
    model = {"pretrained": "sub"}
    shutil.copy(TINY, tmp_path / "conf" / "sub" / "config.json")
    cfg = load_run_config(
        write_run(tmp_path / "conf", {"model": model, "coordinator.model": model})
    )
    assert cfg.coordinator.model.pretrained == str(tmp_path / "conf" / "sub")


@pytest.mark.parametrize(
    "text,message",
    [
        ("{", r"deepspeed_config '\S+/ds.json' is not valid JSON"),
        ("{}", r"deepspeed_config '\S+/ds.json': zero_optimization.stage must be 3 \(ZeRO-3\), got None"),
        ('{"zero_optimization": {"stage": 2}}', r"zero_optimization.stage must be 3 .*got 2"),
        ('{"zero_optimization": 3}', r"zero_optimization.stage must be 3 .*got None"),
        ("[]", r"zero_optimization.stage must be 3"),
    ],
)  # fmt: skip
def test_deepspeed_config_is_checked_at_load(tmp_path, monkeypatch, text, message):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "ds.json").write_text(text)
    (tmp_path / "ds.json").write_text(ZERO3_CPU.read_text())
    monkeypatch.chdir(tmp_path)  # resolved against the run file, never the working directory
    with pytest.raises(ValueError, match=message):
        load_run_config(write_run(tmp_path / "conf", {"deepspeed_config": "ds.json"}))
    island = {"island": "a", "coordinator_url": "http://h:1", "model": {"config": str(TINY)},
              "deepspeed_config": "ds.json", "data": {"path": "t"}}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        load_island_config(write_yaml(tmp_path / "conf" / "island.yaml", island))


def test_a_deepspeed_config_that_is_a_folder_is_said_to_be_one(tmp_path):
    (tmp_path / "ds").mkdir()  # it said 'does not exist'
    with pytest.raises(ValueError, match=r"deepspeed_config '\S+/ds' is a folder, not a JSON"):
        load_run_config(write_run(tmp_path, {"deepspeed_config": "ds"}))


def test_island_file_paths_are_checked_at_load(tmp_path):
    island = {"island": "a", "coordinator_url": "http://h:1", "model": {"config": str(TINY)},
              "deepspeed_config": str(ZERO3_CPU), "data": {"path": "t"}}  # fmt: skip
    path = tmp_path / "island.yaml"
    assert load_island_config(write_yaml(path, island)).deepspeed_config == str(ZERO3_CPU)
    for changes, message in (
        ({"model": {"pretrained": "./m"}}, r"model.pretrained '\S+/m' is not a folder"),
        ({"data.tokenizer": "/no/tok"}, r"data.tokenizer '/no/tok' is not a folder"),
        ({"data.vocab_size": 4097}, r"data.vocab_size \(4097\) is above the vocab_size"),
        ({"deepspeed_config": "ds.json"}, r"deepspeed_config '\S+/ds.json' does not exist"),
    ):
        with pytest.raises(ValueError, match=message):
            load_island_config(write_yaml(path, with_changes(island, changes)))


def test_an_island_file_whose_workdir_is_another_islands_is_refused(tmp_path):
    # island-a.yaml copied for a third island, `island: c` and its shard edited, its workdir
    # left as it was: island c resumed island a's checkpoint (AdamW state, data position of
    # a's shard: "loaded from its universal form") and saved its own over it, silently.
    work = tmp_path / "island-a"
    work.mkdir()
    started = {"island": "a", "step": 0, "tokens": 0, "started_at": 1.0, "resumed": False}
    (work / "progress.jsonl").write_text(
        json.dumps(started) + "\n" + '{"island": "a", "step": 2}\n'
    )
    island = {"island": "a", "coordinator_url": "http://h:1", "model": {"config": str(TINY)},
              "deepspeed_config": str(ZERO3_CPU), "data": {"path": "t"}, "workdir": str(work)}  # fmt: skip
    path = tmp_path / "island.yaml"
    assert load_island_config(write_yaml(path, island)).island == "a"  # its own: resumed
    with pytest.raises(ValueError, match=r"workdir '\S+/island-a' belongs to island 'a' .* "
                       r"island 'c' would resume and overwrite them; give each island a workdir"):  # fmt: skip
        load_island_config(write_yaml(path, {**island, "island": "c"}))
    assert load_island_config(write_yaml(path, {**island, "island": "c", "workdir": "c"}))


def test_example_coordinator_config_values():
    cfg = load_coordinator_config(REPO / "launch" / "coordinator.yaml")
    assert Path(cfg.model.config).resolve() == REPO / "model_configs" / "tiny-llama.json"
    assert Path(cfg.state_dir).resolve() == REPO / "runs" / "coordinator-state"
    assert (cfg.num_fragments, cfg.sync_every, cfg.policy.tau) == (8, 8, 2)
    assert cfg.max_body_mb is None  # the largest upload the model needs
    assert cfg.outer == OuterOptimConfig(name="nesterov", lr=0.7, momentum=0.9)
    assert cfg.staleness == StalenessPolicy(mode="drop")


# --------------------------------------------------------------- loading and paths
def test_relative_paths_resolve_against_the_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir("/")  # the working directory must not matter
    path = write_yaml(
        tmp_path / "conf" / "c.yaml",
        {"model": {"config": "../models/m.json", "seed": 3}, "state_dir": "state"},
    )
    cfg = load_coordinator_config(path)
    assert Path(cfg.model.config).resolve() == tmp_path / "models" / "m.json"
    assert cfg.model.seed == 3
    assert Path(cfg.state_dir) == tmp_path / "conf" / "state"

    path = write_yaml(
        tmp_path / "conf" / "p.yaml", {"model": {"pretrained": "hf"}, "state_dir": "/abs/state"}
    )
    with pytest.raises(ValueError, match=r"model.pretrained '\S+/conf/hf' is not a folder"):
        load_coordinator_config(path)  # the coordinator would fail to build its model
    (tmp_path / "conf" / "hf").mkdir()
    cfg = load_coordinator_config(path)
    assert Path(cfg.model.pretrained) == tmp_path / "conf" / "hf"
    assert cfg.state_dir == "/abs/state"  # absolute paths are kept as they are


def test_a_model_that_is_not_one_is_refused_naming_the_key_when_built(tmp_path):
    """What a coordinator's fresh start builds: a model.config that is not a model's
    config, or a pretrained folder with none, named (a transformers OSError traceback,
    or its 'Should have a `model_type` key in its config.json')."""
    (tmp_path / "bad.json").write_text("not json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^model\.config: '.*bad\.json' is not valid JSON"):
        build_model(ModelSource(config=str(tmp_path / "bad.json")))
    with pytest.raises(ValueError, match=r"^model\.pretrained '.*empty' holds no config\.json"):
        build_model(ModelSource(pretrained=str(tmp_path / "empty")))


def test_a_pretrained_folder_whose_weights_miss_or_misfit_a_parameter_is_refused(
    tmp_path, tiny_config_path
):
    """The coordinator's initial global model is the pretrained one whole: transformers
    fills a tensor the checkpoint lacks with a random init (a printed report, and the run
    fine-tuned a partly random model), and a shape that does not fit is its RuntimeError
    pointing at a report 'above'. Sharded, tied, .bin-only and bf16 folders load exactly."""
    from safetensors.torch import load_file, save_file

    model = build_model(ModelSource(config=tiny_config_path, seed=3))
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    (tmp_path / "bin").mkdir()
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    for folder in ("sharded", "bin"):
        got = dict(build_model(ModelSource(pretrained=str(tmp_path / folder))).named_parameters())
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    got = build_model(ModelSource(pretrained=str(tmp_path / "bf16")))
    assert all(p.dtype == torch.float32 for p in got.parameters())
    assert all(torch.equal(p, want[n].bfloat16().float()) for n, p in got.named_parameters())

    model.float().save_pretrained(tmp_path / "partial")
    weights = tmp_path / "partial" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"partial': .*1 missing \(e\.g\. 'model\.layers\.1\.mlp\.up_proj"
    ):
        build_model(ModelSource(pretrained=str(tmp_path / "partial")))
    config = json.loads((tmp_path / "partial" / "config.json").read_text())
    config["intermediate_size"] += 8
    shutil.copytree(tmp_path / "sharded", tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"other': .*of another shape than its config's"):
        build_model(ModelSource(pretrained=str(tmp_path / "other")))


@pytest.mark.parametrize("damage", ["lfs", "cut"])
def test_a_pretrained_folder_with_a_weight_file_that_is_not_one_is_refused_naming_it(
    tmp_path, tiny_config_path, damage
):
    """A model repo cloned without git-lfs holds pointers, an interrupted copy a file cut
    short: the coordinator failed after the data was prepared, with a SafetensorError naming
    neither the file nor the folder ('header too large'). Now the run file is refused."""
    model = tmp_path / "conf" / "hf"
    build_model(ModelSource(config=tiny_config_path)).save_pretrained(model, max_shard_size="100KB")
    # A file from_pretrained does not read (a Mistral repo's, its LFS object left unfetched)
    # is not the model's.
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n"
    (model / "consolidated.safetensors").write_text(pointer)
    load_run_config(write_run(tmp_path / "conf", {"model": {"pretrained": "hf"}}))
    shard = sorted(model.glob("model-*.safetensors"))[1]
    if damage == "lfs":
        shard.write_text(pointer)
        why = r"is a git-lfs pointer, not the weights: fetch them"
    else:
        shard.write_bytes(shard.read_bytes()[:-100])
        why = r"cannot be read \(.*\): an incomplete copy or download"
    message = rf"^model.pretrained '\S+/hf': {shard.name} {why}"
    with pytest.raises(ValueError, match=message):
        load_run_config(write_run(tmp_path / "conf", {"model": {"pretrained": "hf"}}))
    with pytest.raises(ValueError, match=message):  # a coordinator's own config
        build_model(ModelSource(pretrained=str(model)))


def test_json_file_and_coordinator_section(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**MINIMAL, "num_fragments": 2, "sync_every": 4}))
    cfg = load_coordinator_config(path)
    assert (cfg.num_fragments, cfg.sync_every, cfg.model.config) == (2, 4, "/models/m.json")

    path = write_yaml(tmp_path / "s.yaml", {"coordinator": {**MINIMAL, "port": 9000}})
    assert load_coordinator_config(path).port == 9000
    path = write_yaml(tmp_path / "bad.yaml", {"coordinator": ["not", "a", "mapping"]})
    with pytest.raises(ValueError, match="'coordinator' must hold a mapping"):
        load_coordinator_config(path)


def test_defaults_from_a_minimal_dict():
    cfg = from_dict(CoordinatorConfig, MINIMAL)
    assert cfg == CoordinatorConfig(model=ModelSource(config="/models/m.json"), state_dir="/state")
    assert isinstance(cfg.policy, PolicyOptions)
    assert isinstance(cfg.outer, OuterOptimConfig)
    assert isinstance(cfg.staleness, StalenessPolicy)


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "must hold a mapping at the top level"),
        ("- a\n- b\n", "must hold a mapping at the top level"),
        ("model: [1,\n", "is not valid YAML"),
        ("a: b: c\n", "is not valid YAML"),
        # PyYAML keeps the last of two equal keys; a file saying both is refused.
        ("state_dir: a\nport: 1\nstate_dir: b\n",
         r"is not valid YAML: duplicate key 'state_dir' \(first at line 1\) at line 3, column 1"),
        ("policy: {tau: 1, tau: 2}\n", r"duplicate key 'tau' \(first at line 1\) at line 1"),
        ("a:\n  - {x: 1}\n  - {x: 2, x: 3}\n", r"duplicate key 'x' \(first at line 3\) at line 3"),
    ],
)  # fmt: skip
def test_unreadable_files_are_refused(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_coordinator_config(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_coordinator_config(tmp_path / "missing.yaml")


def test_config_files_that_cannot_be_read_are_refused_naming_them(tmp_path, capsys, monkeypatch):
    """A folder, a file that cannot be read and one that is not UTF-8: one line naming it."""
    with pytest.raises(ValueError, match=r"config file '.*' is a folder, not a file"):
        load_coordinator_config(tmp_path)
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"state_dir: \xff\xfe\n")
    with pytest.raises(ValueError, match=r"config file '.*c\.yaml' is not UTF-8 text"):
        load_coordinator_config(binary)
    unreadable = tmp_path / "u.yaml"
    unreadable.write_text("state_dir: s\n")
    real = Path.read_text

    def read_text(self, *args, **kwargs):  # chmod 000 does not stop root
        if self == unreadable:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    with pytest.raises(ValueError, match=r"config file '.*u\.yaml' cannot be read: Permission"):
        load_run_config(unreadable)
    assert cli.main(["run", str(unreadable)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-diloco: error: config file ") and len(err.splitlines()) == 1, err


def test_equal_keys_in_different_mappings_and_merge_overrides_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "base: &base {tau: 2, min_quorum: 1}\n"  # an anchor, merged below and overridden
        "coordinator:\n  model: {config: m.json, seed: 1}\n  state_dir: s\n"
        "  policy: {<<: *base, tau: 1}\n  outer: {lr: 0.5}\n"
    )
    cfg = load_coordinator_config(path)
    assert (cfg.policy.tau, cfg.policy.min_quorum, cfg.outer.lr, cfg.model.seed) == (1, 1, 0.5, 1)


# --------------------------------------------------------------- unknown keys, types
@pytest.mark.parametrize(
    "key,dotted",
    [
        ("sync_evry", "sync_evry"),
        ("policy.min_qourum", "policy.min_qourum"),
        ("model.seeed", "model.seeed"),
        ("outer.lrr", "outer.lrr"),
        ("staleness.discount", "staleness.discount"),
    ],
)
def test_unknown_keys_are_refused_by_dotted_path(tmp_path, key, dotted):
    data = with_changes(MINIMAL, {key: 1})
    with pytest.raises(ValueError, match=rf"unknown key\(s\) '{dotted}'; known: "):
        from_dict(CoordinatorConfig, data)
    with pytest.raises(ValueError, match=rf"'{dotted}'"):
        load_coordinator_config(write_yaml(tmp_path / "c.yaml", data))


def test_all_unknown_keys_are_listed_and_non_string_keys_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"'policy.a', 'policy.b'; known: grace_gamma"):
        from_dict(CoordinatorConfig, with_changes(MINIMAL, {"policy.b": 1, "policy.a": 2}))
    # YAML reads `on:` as the boolean True and `2:` as an integer.
    path = tmp_path / "c.yaml"
    path.write_text("model: {config: m.json}\nstate_dir: s\non: 1\n2: 2\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) '2', 'True'"):
        load_coordinator_config(path)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("num_fragments", "8", "num_fragments: expected int, got '8'"),
        ("num_fragments", 8.0, "num_fragments: expected int, got 8.0"),
        ("num_fragments", True, "num_fragments: expected int, got True"),
        ("port", None, "port: expected int, got None"),
        ("max_body_mb", "big", "max_body_mb: expected float, got 'big'"),
        ("max_body_mb", True, "max_body_mb: expected float, got True"),
        ("host", 127, "host: expected str, got 127"),
        ("token", 123, "token: expected str, got 123"),
        ("plain_patterns", "embed", "plain_patterns: expected a list"),
        ("plain_patterns", ["embed", 1], "plain_patterns: expected str, got 1"),
        ("policy.tau", 1.5, "policy.tau: expected int, got 1.5"),
        ("outer.lr", "0.7", "outer.lr: expected float, got '0.7'"),
        ("model.seed", "0", "model.seed: expected int, got '0'"),
        ("model.config", 5, "model.config: expected str, got 5"),
        ("model.config", ["a"], r"model.config: expected str, got \['a'\]"),
        ("state_dir", 5, "state_dir: expected str, got 5"),
        ("policy", 3, "^policy: expected a mapping, got int"),
        ("outer", None, "^outer: expected a mapping, got NoneType"),
        ("model", "m.json", "^model: expected a mapping, got str"),
    ],
)
def test_wrong_types_are_refused_naming_the_field(tmp_path, key, value, message):
    data = with_changes(MINIMAL, {key: value})
    with pytest.raises(ValueError, match=message):
        load_coordinator_config(write_yaml(tmp_path / "c.yaml", data))


def test_ints_are_accepted_for_floats():
    cfg = from_dict(CoordinatorConfig, with_changes(MINIMAL, {"max_body_mb": 2, "outer.lr": 1}))
    assert type(cfg.max_body_mb) is float and cfg.max_body_mb == 2.0
    assert type(cfg.outer.lr) is float


@pytest.mark.parametrize("missing", ["model", "state_dir"])
def test_missing_required_field_is_named(missing):
    with pytest.raises(ValueError, match=f"^missing key\\(s\\) '{missing}'$"):
        from_dict(CoordinatorConfig, with_changes(MINIMAL, {missing: ...}))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"data.path": ...}, "missing key(s) 'data.path'"),
        ({"islands": [{"world_size": 1}]}, "missing key(s) 'islands.name'"),
        ({"deepspeed_config": ...}, "missing key(s) 'deepspeed_config'"),
    ],
)
def test_a_run_files_missing_keys_are_named_by_dotted_path(tmp_path, changes, message):
    """Not as a dataclass's __init__ arguments ('data.: DataConfig.__init__() missing 1
    required keyword-only argument: 'path'')."""
    run = {"model": {"config": str(TINY)}, "deepspeed_config": str(ZERO3_CPU),
           "data": {"path": str(tmp_path)}, "islands": [{"name": "a"}],
           "workdir": str(tmp_path / "run")}  # fmt: skip
    with pytest.raises(ValueError) as e:
        load_run_config(write_yaml(tmp_path / "run.yaml", with_changes(run, changes)))
    assert str(e.value) == message


# --------------------------------------------------------------- validation rules
@pytest.mark.parametrize(
    "changes,message",
    [
        ({"num_fragments": 0}, r"num_fragments must be >= 1, got 0"),
        ({"fragmentation": "random"}, r"fragmentation must be 'balanced' or 'layer'"),
        (
            {"num_fragments": 4, "sync_every": 10},
            r"sync_every \(10\) must be a multiple of num_fragments \(4\)",
        ),
        (
            {"num_fragments": 4, "sync_every": 8, "policy.tau": 8},
            r"policy.tau \(8\) must be < sync_every \(8\)",
        ),
        ({"save_every_merges": 0}, r"save_every_merges must be >= 1, got 0"),
        ({"max_body_mb": 0}, r"max_body_mb must be > 0 and finite, got 0"),
        ({"max_body_mb": -1.5}, r"max_body_mb must be > 0 and finite, got -1.5"),
        ({"max_body_mb": float("nan")}, r"max_body_mb must be > 0 and finite, got nan"),
        ({"max_body_mb": float("inf")}, r"max_body_mb must be > 0 and finite, got inf"),
        ({"island_timeout_s": 0}, r"island_timeout_s must be > 0 and finite, got 0"),
        ({"island_timeout_s": -1}, r"island_timeout_s must be > 0"),
        ({"island_timeout_s": float("nan")}, r"island_timeout_s must be > 0 and finite, got nan"),
        ({"uptime_window_s": float("nan")}, r"uptime_window_s must be > 0 and finite, got nan"),
        ({"port": 65536}, r"port must be in 0..65535, got 65536"),
        ({"port": -1}, r"port must be in 0..65535, got -1"),
        ({"plain_patterns": ["[bad"]}, r"plain_patterns: '\[bad' is not a regex"),
        # Checked before the rules that divide by or compare with it.
        ({"sync_every": 0}, r"^sync_every must be >= 1, got 0"),
        ({"sync_every": -8, "num_fragments": 8}, r"^sync_every must be >= 1, got -8"),
        ({"model.pretrained": "/hf"}, r"model: set exactly one of 'pretrained'"),
        ({"model.config": ...}, r"model: set exactly one of 'pretrained'"),
        ({"model.config": None}, r"model: set exactly one of 'pretrained'"),
        # Nested configs validate themselves; from_dict says where the section is.
        ({"policy.min_quorum": 0}, r"^policy: PolicyOptions.min_quorum must be >= 1"),
        ({"policy.grace_gamma": 1.0}, r"^policy: PolicyOptions.grace_gamma must be in \[0, 1\)"),
        ({"policy.max_grace_s": -1}, r"^policy: PolicyOptions.max_grace_s must be >= 0"),
        ({"policy.tau": 0}, r"^policy: PolicyOptions.tau must be >= 1"),
        ({"outer.name": "adam"}, r"^outer: OuterOptimConfig.name must be one of"),
        ({"outer.lr": 0}, r"^outer: OuterOptimConfig.lr must be > 0"),
        ({"outer.momentum": 1.0}, r"^outer: OuterOptimConfig.momentum must be in \[0, 1\)"),
        ({"outer.every": 0}, r"^outer: OuterOptimConfig.every must be >= 1"),
        ({"staleness.mode": "keep"}, r"^staleness: StalenessPolicy.mode must be one of"),
        ({"staleness.discount_lambda": -1}, r"^staleness: StalenessPolicy.discount_lambda must be"),
    ],
)
def test_validation_rules_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        from_dict(CoordinatorConfig, with_changes(MINIMAL, changes))


def test_validation_boundaries_are_accepted():
    ok = [
        {"num_fragments": 1, "sync_every": 7, "policy.tau": 6},
        {"num_fragments": 4, "sync_every": 4, "policy.tau": 3},
        {"num_fragments": 3, "sync_every": 12, "fragmentation": "layer"},
        {"save_every_merges": 1, "max_body_mb": 0.001, "island_timeout_s": 0.01},
        {"model.config": ..., "model.pretrained": "/hf"},
    ]
    for changes in ok:
        from_dict(CoordinatorConfig, with_changes(MINIMAL, changes))


def test_rules_hold_for_direct_construction_too():
    model = ModelSource(config="m.json")
    with pytest.raises(ValueError, match="num_fragments"):
        CoordinatorConfig(model=model, state_dir="s", num_fragments=0)
    with pytest.raises(ValueError, match=r"policy\.tau"):
        CoordinatorConfig(
            model=model, state_dir="s", num_fragments=2, sync_every=2, policy=PolicyOptions(tau=2)
        )
    with pytest.raises(ValueError, match="exactly one"):
        ModelSource(config="m.json", pretrained="/hf")
    with pytest.raises(ValueError, match="exactly one"):
        ModelSource()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"connect_timeout_s": 0}, "connect_timeout_s must be > 0"),
        ({"start_timeout_s": -1}, "start_timeout_s must be > 0"),
        ({"start_together": -1}, "start_together must be >= 0"),
        ({"shard": 2, "num_shards": 2}, r"shard must be in \[0, num_shards=2\)"),
        ({"coordinator_url": "10.0.0.1:8470"}, "coordinator_url must be http"),
        ({"coordinator_url": "http://:8470"}, "coordinator_url must be http"),
        # Refused at load, not in every rank as it reaches the coordinator.
        (
            {"coordinator_url": "http://10.0.0.1:99999"},
            r"^coordinator_url 'http://10.0.0.1:99999': Port out of range",
        ),
        (
            {"coordinator_url": "http://10.0.0.1:abc"},
            r"^coordinator_url 'http://10.0.0.1:abc': Port",
        ),
        # The coordinator's rule for island ids: they go into URLs and file paths.
        *[
            ({"island": n}, rf"^island must be 1-128 of .*, got {re.escape(repr(n))}")
            for n in BAD_NAMES
        ],
    ],
)
def test_island_config_rules_name_the_field(changes, message):
    base = dict(island="a", coordinator_url="http://127.0.0.1:8470",
                model=ModelSource(config="m.json"), deepspeed_config="ds.json",
                data=DataConfig(path="corpus"))  # fmt: skip
    assert IslandConfig(**base).connect_timeout_s == 30.0
    with pytest.raises(ValueError, match=message):
        IslandConfig(**{**base, **changes})


# --------------------------------------------------------------- token
def token_cfg(tmp_path, **kw) -> CoordinatorConfig:
    return CoordinatorConfig(
        model=ModelSource(config="m.json"), state_dir=str(tmp_path / "state"), **kw
    )


def test_token_from_config_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert token_cfg(tmp_path, token="from-config").resolve_token() == "from-config"
    assert not (tmp_path / "state").exists()


def test_token_from_environment_next(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert token_cfg(tmp_path).resolve_token() == "from-env"
    assert not (tmp_path / "state" / "token").exists()


def test_token_file_created_private_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cfg = token_cfg(tmp_path)
    token = cfg.resolve_token()
    path = tmp_path / "state" / "token"
    assert path.read_text() == token
    assert len(token) >= 32  # secrets.token_urlsafe(32): 256 random bits
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # a bearer token: owner only
    assert cfg.resolve_token() == token
    assert token_cfg(tmp_path).resolve_token() == token  # a restarted coordinator
    other = tmp_path / "other"
    assert token_cfg(other).resolve_token() != token  # random, not derived from anything


def test_empty_token_file_is_refused(tmp_path, monkeypatch):
    """An empty token would let in any request that sends ``Bearer `` with nothing."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "token").write_text("\n")
    with pytest.raises(ValueError, match=r"token file .* is empty"):
        token_cfg(tmp_path).resolve_token()


# --------------------------------------------------------------- CLI
@pytest.fixture
def no_serving(monkeypatch):
    """If a config loaded after all, fail instead of serving forever."""
    import ds_diloco.server

    def refuse(cfg):
        raise AssertionError(f"the config loaded: {cfg}")

    monkeypatch.setattr(ds_diloco.server, "serve_forever", refuse)


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "model: {config: m.json}\nstate_dir: s\npolicy: {min_qourum: 2}\n",
            "unknown key(s) 'policy.min_qourum'",
        ),
        ("model: {config: m.json}\nstate_dir: s\nnum_fragments: 0\n", "num_fragments must be"),
        ("model: {config: [m.json\n", "is not valid YAML"),
    ],
)
def test_cli_prints_one_error_line(tmp_path, capsys, no_serving, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli.main(["coordinator", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ds-diloco: error: ")
    assert message in lines[0]
    assert "Traceback" not in err


def test_cli_missing_config_file(tmp_path, capsys, no_serving):
    assert cli.main(["coordinator", "--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-diloco: error: config file ")
    assert "does not exist" in err


def test_the_learner_steps_in_every_other_block_from_the_first_or_the_second():
    assert all(learner_steps_at(step, 0) for step in range(1, 9))  # no blocks: every step
    assert [learner_steps_at(step, 2) for step in range(1, 9)] == [1, 1, 0, 0, 1, 1, 0, 0]
    assert [learner_steps_at(step, 2, off_first=True) for step in range(1, 9)] == [
        0, 0, 1, 1, 0, 0, 1, 1,
    ]  # fmt: skip
    assert [learner_steps_at(step, 3, off_first=True) for step in range(1, 8)] == [
        0, 0, 0, 1, 1, 1, 0,
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"sync_blocks_off_first needs train\.sync_blocks > 0"):
        TrainConfig(sync_blocks_off_first=True)
    assert TrainConfig(sync_blocks=4, sync_blocks_off_first=True).sync_blocks_off_first
