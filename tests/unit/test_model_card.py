"""Model cards and the Hub: `register` writes a README.md card (front matter the Hub reads, the
data fingerprints, the gates, the evaluation table) into the registered model directory,
which transformers still loads; `register.push_to_hub` and `python -m posttrain.registry push`
upload that directory with the real `huggingface_hub` client to a local stand-in of the Hub
API (tests/hub_standin.py), byte for byte; offline or unreachable, the upload is skipped with
one line saying how to push later, and the registration stands."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hub_standin import TOKEN, HubStandIn
from tiny_models import save_tiny_demo_model

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = REPO_ROOT / "configs" / "sft" / "tiny.yaml"
BASE_CARD = "---\nlicense: apache-2.0\nlanguage: [en]\n---\n\n# tiny-base\n\nBASE CARD: the base model's own text.\n"
LOOPBACK = ("127.0.0.1", "::1", "localhost")

TRAIN_SUMMARY = {"steps": 6, "num_parameters": 28896, "trainable_parameters": 28896, "num_workers": 1,
                 "first_loss": 5.5125, "final_loss": 3.1782, "tokens": 6027, "train_seconds": 1.93,
                 "tokens_per_s": 3123.4, "pad_token": {"token": "<pad>", "id": 0, "source": "tokenizer"}}
EVAL = {"base": {"exact_match": 0.25, "exact_match_se": 0.1, "heldout_loss": 4.5},
        "tuned": {"exact_match": 0.75, "exact_match_se": 0.05, "heldout_loss": 2.125},
        "promoted": {"exact_match": 0.5, "exact_match_se": 0.125, "heldout_loss": 3.0}}
SKEW = {"serving_dir": "checkpoint", "checked": {"conversation": 32, "generation prompt": 32}, "mismatched": 0,
        "mismatches": [], "end_of_turn_ids": [2], "serving_stop_ids": [2], "missing_stop_ids": [],
        "stop_message": None, "serving_stacks": ["transformers"], "notes": [], "passed": True}


def front_matter_of(card: str) -> dict:
    """The YAML between the card's leading `---` lines, parsed here independently of our reader."""
    assert card.startswith("---\n"), card[:80]
    meta = yaml.safe_load(card.split("\n---\n", 1)[0][len("---\n"):])
    assert isinstance(meta, dict)
    return meta


def table_row(card: str, first_cell: str) -> list[str]:
    """The cells of the Markdown table row that starts with `first_cell`."""
    rows = [line for line in card.splitlines() if line.startswith(f"| {first_cell} |")]
    assert len(rows) == 1, (first_cell, rows)
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def recipe_config(tmp: Path, start: Path, **register):
    """configs/sft/tiny.yaml fine-tuning the Hub model `acme/tiny-base` (its snapshot: `start`),
    with a Hub dataset among its sources, registering into `tmp / "registry"`."""
    from posttrain.config.loader import sft_config_from_dict

    data = yaml.safe_load(TINY.read_text())
    data["data"]["sources"].append({"name": "gsm8k", "kind": "hf", "path": "openai/gsm8k", "subset": "main",
                                    "format": "gsm8k_chat"})
    data["tokenizer"] = {"name_or_path": str(start)}
    data["model"] = {"init": "pretrained", "name_or_path": "acme/tiny-base"}
    data["register"] = {"registry_dir": str(tmp / "registry"), "model_name": "card-demo", **register}
    return sft_config_from_dict(data)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny base model with its Hub card (license apache-2.0), the "trained" export (its copy,
    README.md included, as an export that copies the base's files), the data files, and the
    real logit verification verdict of the export."""
    from posttrain.config.schema import VerifyConfig
    from posttrain.data.sources import fingerprint
    from posttrain.steps import verify

    tmp = tmp_path_factory.mktemp("card")
    start = save_tiny_demo_model(tmp)
    (start / "README.md").write_text(BASE_CARD)
    checkpoint = tmp / "checkpoint"
    shutil.copytree(start, checkpoint)
    train_file, heldout_file = tmp / "train.jsonl", tmp / "heldout.jsonl"
    for path, (question, answer) in ((train_file, ("1 + 1", "2")), (heldout_file, ("2 + 2", "4"))):
        path.write_text(json.dumps({"messages": [{"role": "user", "content": question},
                                                 {"role": "assistant", "content": answer}]}) + "\n")
    verdict = verify.run(str(checkpoint), VerifyConfig(), device="cpu")
    return {"tmp": tmp, "start": start, "checkpoint": checkpoint, "verdict": verdict,
            "fingerprints": {"arithmetic": fingerprint(train_file), "gsm8k": fingerprint("openai/gsm8k"),
                             "arithmetic-heldout": fingerprint(heldout_file)}}


def register(trained, tmp: Path, **register_section):
    from posttrain.steps import register as register_step

    config = recipe_config(tmp, trained["start"], **register_section)
    counts = {"arithmetic": {"kept": 300, "read": 301, "rejected": 1}, "gsm8k": {"kept": 40, "read": 40, "rejected": 0},
              "arithmetic-heldout": {"kept": 16, "read": 16, "rejected": 0}}
    metrics = {"train": TRAIN_SUMMARY, "eval": EVAL, "eval_errors": {"grader": "ConnectionError: grading service down"},
               "verify": trained["verdict"], "skew": SKEW}
    return register_step.run(str(trained["checkpoint"]), config, data_counts=counts, metrics=metrics,
                             run_pathspec="SFTFlow/42", parent_dir=str(trained["start"]),
                             data_fingerprints=trained["fingerprints"])


@pytest.fixture(scope="module")
def registered(trained):
    return register(trained, trained["tmp"])


@pytest.fixture
def loopback_only(monkeypatch):
    """Nothing in this process reaches past 127.0.0.1 during the test (names or connections)."""
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:
            raise ConnectionRefusedError(f"test: no network beyond the loopback ({address[0]})")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in LOOPBACK:
            raise socket.gaierror(f"test: no name resolution beyond the loopback ({host})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture
def hub_client_online(monkeypatch, loopback_only):
    """The already imported `huggingface_hub` of this process, online, pointed at `endpoint(url)`
    (its constants are read when it is imported: they are set here, for this test only)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    def endpoint(url: str) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", url)

    return endpoint


def model_files(model_dir: str | Path) -> dict[str, bytes]:
    root = Path(model_dir)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- the card ---------------------------------------------------------------------------------


def test_registered_model_has_a_card_the_hub_reads(registered, trained):
    from posttrain.registry.local import load_lineage

    card = (Path(registered.model_path) / "README.md").read_text()
    meta = front_matter_of(card)
    assert meta == {"license": "apache-2.0", "base_model": "acme/tiny-base", "library_name": "transformers",
                    "pipeline_tag": "text-generation", "tags": ["posttrain", "sft"], "datasets": ["openai/gsm8k"]}
    assert "BASE CARD" not in card  # the base model's card, copied with the export, is replaced
    assert (trained["checkpoint"] / "README.md").read_text() == BASE_CARD  # in the registry copy only
    lineage = load_lineage(registered.path)
    assert lineage["license"] == {"id": "apache-2.0", "source": str(trained["start"] / "README.md")}
    assert (lineage["kind"], lineage["base_model"]) == ("sft", "acme/tiny-base")

    # the model, its base, the data with its fingerprints, training
    assert "# card-demo (v1)" in card and "`card-demo:v1`" in card and "`SFTFlow/42`" in card
    commit = lineage["code"]["git_commit"]
    assert commit is None or f"`{commit[:12]}`" in card
    assert "Trained from `acme/tiny-base`" in card and "[acme/tiny-base](https://huggingface.co/acme/tiny-base)" in card
    arithmetic = table_row(card, "`arithmetic`")
    fingerprint = trained["fingerprints"]["arithmetic"]
    assert arithmetic[1:] == ["train", "jsonl", "`${generated}/train.jsonl`", "chat", "300", "301", "1",
                              f"{fingerprint['bytes']:,}", f"`{fingerprint['sha256']}`"]
    assert table_row(card, "`gsm8k`")[3] == "`openai/gsm8k (main), split train`"
    assert table_row(card, "`gsm8k`")[-1] == "-"  # a Hub dataset: its id, no local digest
    heldout = trained["fingerprints"]["arithmetic-heldout"]
    assert table_row(card, "`arithmetic-heldout`")[1] == "held-out"
    assert f"`{heldout['sha256']}`" in card
    assert table_row(card, "final loss (mean of the last steps)")[1] == "3.178"
    assert table_row(card, "tokens trained")[1] == "6,027"
    assert "learning_rate 0.003" in card


def test_card_states_the_gates_and_the_evaluation_table(registered, trained):
    card = (Path(registered.model_path) / "README.md").read_text()
    verdict = trained["verdict"]
    assert verdict["passed"]
    (verify_line,) = [line for line in card.splitlines() if line.startswith("- **Logit verification**")]
    assert verify_line.startswith("- **Logit verification**: PASS")
    assert f"max |difference| {verdict['max_abs_diff']:.4g}" in verify_line and "tolerance of 0.0001" in verify_line
    (skew_line,) = [line for line in card.splitlines() if line.startswith("- **Train/serve skew gate**")]
    assert skew_line.startswith("- **Train/serve skew gate**: PASS")
    assert "records checked: conversation 32, generation prompt 32; 0 mismatches, on transformers" in skew_line

    assert table_row(card, "Metric") == ["Metric", "base", "tuned", "promoted"]
    assert table_row(card, "`exact_match`")[1:] == ["0.25 ± 0.1", "0.75 ± 0.05", "0.5 ± 0.125"]
    assert table_row(card, "`heldout_loss`")[1:] == ["4.5", "2.125", "3"]
    assert "`exact_match_se`" not in card  # standard errors go with their metric
    assert "- `grader`: ConnectionError: grading service down" in card
    for section in ("## Intended use", "## Limitations", "## License", "## How to use"):
        assert section in card
    assert 'resolve_model_dir("registry:card-demo:1")' in card


def test_card_says_fail_and_asks_for_a_license_where_the_lineage_does(registered):
    from posttrain.registry.card import render_model_card
    from posttrain.registry.local import load_lineage

    lineage = load_lineage(registered.path)
    lineage["metrics"]["verify"] = {**lineage["metrics"]["verify"], "passed": False, "max_abs_diff": 0.5}
    lineage["metrics"]["skew"] = None
    lineage.update(parent=None, ancestry=[], base_model=None, license={"id": "other", "source": None})
    lineage["data"]["sources"] = [s for s in lineage["data"]["sources"] if s["kind"] != "hf"]
    card = render_model_card(lineage)
    meta = front_matter_of(card)
    assert meta["license"] == "other" and "base_model" not in meta and "datasets" not in meta
    assert "- **Logit verification**: FAIL" in card and "max |difference| 0.5 " in card
    assert "- **Train/serve skew gate**: not run." in card
    assert "no license was chosen for this model. Set `register.license`" in card
    assert "random initialisation" in card
    reward_model = render_model_card({**lineage, "kind": "rm"})
    assert front_matter_of(reward_model)["pipeline_tag"] == "text-classification"
    assert 'subfolder="sequence_classifier"' in reward_model
    assert render_model_card({"recipe": "bare"}).startswith("---\nlicense: other\n")  # anything renders


def test_transformers_and_the_registry_still_read_the_directory(registered):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.registry import resolve_model_dir
    from posttrain.registry.promotion import promote

    registry = Path(registered.path).parents[1]
    assert resolve_model_dir("registry:card-demo", registry_dir=registry) == Path(registered.model_path)
    model = AutoModelForCausalLM.from_pretrained(registered.model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(registered.model_path)
    ids = torch.tensor([tokenizer("12 + 30")["input_ids"]])
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size
    assert promote(registry, "card-demo", 1)["version"] == 1  # the gates read the lineage, not the card


def test_a_chained_registration_inherits_the_license_and_names_the_hub_ancestor(registered, trained, tmp_path):
    from posttrain.config.loader import sft_config_from_dict
    from posttrain.steps import register as register_step

    registry = Path(registered.path).parents[1]
    data = yaml.safe_load(TINY.read_text())
    data["tokenizer"] = {"name_or_path": str(trained["start"])}
    data["model"] = {"init_from": "registry:card-demo:1"}
    data["register"] = {"registry_dir": str(registry), "model_name": "card-demo-dpo"}
    child = register_step.run(str(trained["checkpoint"]), sft_config_from_dict(data), data_counts={},
                              metrics={}, run_pathspec="SFTFlow/43", parent_dir=registered.model_path)
    card = (Path(child.model_path) / "README.md").read_text()
    meta = front_matter_of(card)
    assert (meta["license"], meta["base_model"]) == ("apache-2.0", "acme/tiny-base")
    assert "(the nearest ancestor there)" in card
    assert "1. `card-demo:v1`" in card and "2. `acme/tiny-base`" in card  # the parent chain
    assert "(set by" not in card and "registry entry card-demo:v1" in json.dumps(
        json.loads((Path(child.path) / "lineage.json").read_text())["license"])


def test_register_config_checks_the_hub_repository_and_the_license(trained, tmp_path):
    from posttrain.config.strict import ConfigError

    for bad in ("no-owner", "owner/name/extra", "owner/../x", "owner/na me"):
        with pytest.raises(ConfigError, match=re.escape("register.push_to_hub must be a Hub repository id")):
            recipe_config(tmp_path, trained["start"], push_to_hub=bad)
    with pytest.raises(ConfigError, match=re.escape("register.license")):
        recipe_config(tmp_path, trained["start"], license="Apache 2.0")
    with pytest.raises(ConfigError, match=re.escape("register.hub_revision")):
        recipe_config(tmp_path, trained["start"], hub_revision="dev")
    config = recipe_config(tmp_path, trained["start"], push_to_hub="acme/card-demo", hub_private=True, license="mit")
    assert (config.register.push_to_hub, config.register.hub_private, config.register.license) == (
        "acme/card-demo", True, "mit")


# --- the Hub ------------------------------------------------------------------------------------


def test_push_command_uploads_the_registered_directory_byte_for_byte(registered, tmp_path):
    """`python -m posttrain.registry push` in a child process whose huggingface_hub is online
    against the stand-in (HF_ENDPOINT, HF_HUB_OFFLINE=0, a dummy token, its own HF_HOME) and
    cannot resolve or connect to anything but the loopback."""
    from posttrain.registry.local import load_lineage

    registry = Path(registered.path).parents[1]
    guard = ("import socket, sys\n"
             "real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo\n"
             f"LOOPBACK = {LOOPBACK!r}\n"
             "def connect(sock, address):\n"
             "    if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:\n"
             "        raise ConnectionRefusedError(address)\n"
             "    return real_connect(sock, address)\n"
             "def getaddrinfo(host, *args, **kwargs):\n"
             "    if host not in LOOPBACK:\n"
             "        raise socket.gaierror(host)\n"
             "    return real_getaddrinfo(host, *args, **kwargs)\n"
             "socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo\n"
             "from posttrain.registry.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")
    with HubStandIn() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
               "HF_TOKEN": hub.token, "HF_HOME": str(tmp_path / "hf-home"), "NO_PROXY": "127.0.0.1,localhost",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

        def push(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-c", guard, "--registry", str(registry), "push", *args],
                                  env=env, capture_output=True, text=True, timeout=300)

        done = push("card-demo:1", "acme/card-demo", "--private")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "[hub] card-demo v1 pushed to the Hub: acme/card-demo" in done.stdout
        local = model_files(registered.model_path)
        assert "README.md" in local and any(name.endswith(".safetensors") for name in local)
        assert hub.files("acme/card-demo") == local  # every file, byte for byte, the card included
        assert hub.repos["acme/card-demo"]["private"]
        (commit,) = hub.commits("acme/card-demo")
        assert commit["summary"] == "posttrain: card-demo:v1 (recipe sft-tiny, run SFTFlow/42)"
        recorded = load_lineage(registered.path)["hub"]
        assert recorded["pushed"] and recorded["repo"] == "acme/card-demo"
        assert recorded["url"] == f"{hub.url}/acme/card-demo/commit/{commit['oid']}"
        assert not [path for _, path in hub.requests if "lfs" in path or "xet" in path]

        again = push("card-demo:1", "acme/card-demo", "--revision", "v1")  # a branch of its own, created
        assert again.returncode == 0, again.stdout + again.stderr
        assert hub.files("acme/card-demo", "v1") == local
        assert ("POST", "/api/models/acme/card-demo/branch/v1") in hub.requests

        refused = subprocess.run([sys.executable, "-c", guard, "--registry", str(registry), "push", "card-demo:1",
                                  "acme/card-demo"], env={**env, "HF_TOKEN": "wrong"}, capture_output=True,
                                 text=True, timeout=300)
        assert refused.returncode == 1 and "not pushed to acme/card-demo: the Hub refused the token" in refused.stdout


def test_register_pushes_after_registering(trained, tmp_path, hub_client_online):
    from posttrain.registry.hub import push_entry
    from posttrain.registry.local import list_versions, load_lineage, register_model

    with HubStandIn() as hub:
        hub_client_online(hub.url)
        entry = register(trained, tmp_path, push_to_hub="acme/pushed-at-register")
        assert entry.hub["pushed"] and entry.hub["url"].startswith(f"{hub.url}/acme/pushed-at-register/commit/")
        assert load_lineage(entry.path)["hub"] == entry.hub
        assert hub.files("acme/pushed-at-register") == model_files(entry.model_path)
        assert not hub.repos["acme/pushed-at-register"]["private"]

        # an entry registered before model cards (the base model's README.md copied as it was) gets its card
        old = register_model(tmp_path / "registry", "before-cards", trained["checkpoint"], {"recipe": "old"})
        assert (Path(old.model_path) / "README.md").read_text() == BASE_CARD
        assert push_entry(old, "acme/before-cards")["pushed"]
        card = hub.files("acme/before-cards")["README.md"].decode()
        assert front_matter_of(card)["tags"] == ["posttrain"] and "BASE CARD" not in card
        assert hub.files("acme/before-cards") == model_files(old.model_path)
    assert [e.version for e in list_versions(tmp_path / "registry", "card-demo")] == [1]


def test_offline_push_is_skipped_with_a_line_saying_how_to_push_later(trained, tmp_path, capsys, monkeypatch,
                                                                       loopback_only):
    from huggingface_hub import constants

    from posttrain.registry.local import load_lineage

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 (the Makefile's) sets
    entry = register(trained, tmp_path, push_to_hub="acme/offline")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[hub]")]
    assert lines == [f"[hub] card-demo v1 not pushed to acme/offline: the Hub is offline for huggingface_hub "
                     f"(HF_HUB_OFFLINE=1); it stays registered. Push it later with: HF_HUB_OFFLINE=0 python -m "
                     f"posttrain.registry --registry {tmp_path.resolve() / 'registry'} push card-demo:1 acme/offline"]
    assert entry.hub["pushed"] is False and "offline" in entry.hub["reason"]
    assert load_lineage(entry.path)["hub"] == entry.hub
    assert (Path(entry.model_path) / "README.md").is_file() and (Path(entry.model_path) / "config.json").is_file()


def test_an_unreachable_hub_leaves_the_registration_as_it_is(registered, tmp_path, capsys, hub_client_online):
    from posttrain.registry.cli import main
    from posttrain.registry.local import load_lineage

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    hub_client_online(f"http://127.0.0.1:{closed}")
    registry = Path(registered.path).parents[1]
    before = model_files(registered.model_path)
    assert main(["--registry", str(registry), "push", "card-demo:1", "acme/unreachable"]) == 1
    out = capsys.readouterr().out
    assert f"not pushed to acme/unreachable: the Hub at http://127.0.0.1:{closed} is unreachable" in out
    assert "Push it later with: python -m posttrain.registry" in out
    assert model_files(registered.model_path) == before
    assert load_lineage(registered.path)["hub"]["pushed"] is False
