# Where checkpoints and data sets come from: a local path, a short alias, or a Hugging Face hub id.
# Every --ckpt (generate.py, serve.py, the tools) and train.py --init resolve here; data.py downloads
# hub data sets here. huggingface_hub is imported only when something must be downloaded, so runs on
# local directories never touch the network. A downloaded id lives in the Hugging Face cache
# (HF_HOME); with HF_HUB_OFFLINE=1 a cached id resolves without any network call.
import re
from pathlib import Path

ALIASES = {"qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct"}
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name
# What a checkpoint needs: config.json, generation_config.json, safetensors (and their index), the
# tokenizer in any of its layouts and a chat_template.jinja. No *.bin or *.pth duplicates.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.tiktoken", "*.jinja"]
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # chat data files (mars/examples.py)


def download(repo_id: str, repo_type: str, patterns: list[str], what: str, fix: str) -> Path:
    # -> the local snapshot folder. Any failure (offline, unknown id, gated, disk) is one line:
    # "{what}, and downloading ... failed (ErrorClass). Offline? {fix}".
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, allow_patterns=patterns))
    except Exception as e:  # the fix is the same whatever went wrong, the class name says what it was
        raise FileNotFoundError(f"{what}, and downloading {repo_id} from the Hugging Face hub failed "
                                f"({type(e).__name__}). Offline? {fix}") from e


def resolve_checkpoint(spec: str, flag: str = "--ckpt", fix: str = "") -> Path:
    # spec: a checkpoint directory, an alias (qwen2.5-0.5b, qwen2.5-7b) or a hub id (owner/name),
    # downloaded on first use. -> a local directory; the caller reads config.json and the weights. fix: how to
    # give a downloaded copy instead (default: pass its directory as `flag`).
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        raise FileNotFoundError(f"{flag} {spec} is a file: pass the checkpoint directory that holds it")
    if spec.lower() not in ALIASES and looks_local(spec):
        raise FileNotFoundError(f"{flag} {spec}: checkpoint directory not found{nearby(path)}; pass the folder "
                                "train.py wrote (config.json, *.safetensors, tokenizer files), or a hub id")
    repo = ALIASES.get(spec.lower(), spec)
    if not HUB_ID.fullmatch(repo):
        raise FileNotFoundError(f"{flag} {spec}: checkpoint directory not found, and not an alias "
                                f"({', '.join(ALIASES)}) or a hub id (owner/name); pass a Hugging Face "
                                "model directory (config.json, *.safetensors, tokenizer files)")
    fix = f"Download it where you are online (hf download {repo}) and {fix or f'pass its directory: {flag} PATH'}"
    folder = download(repo, "model", CHECKPOINT_FILES, f"{flag} {spec}: not a local directory", fix)
    if not all_weights(folder):  # the hub's cache can hold a snapshot of the configs alone, or of some shards
        raise FileNotFoundError(f"{flag} {spec}: the cached copy of {repo} ({folder}) lacks *.safetensors weights: "
                                f"a partial download, which offline cannot complete (or a repository of .bin weights "
                                f"only, which this code does not read). {fix}")
    return folder


def all_weights(folder: Path) -> bool:
    # The weights files.checkpoint_files would read are all there: not a snapshot of the configs alone, or of
    # some shards. A damaged file or index counts as there: loading names it.
    from mars.files import checkpoint_files

    try:
        checkpoint_files(folder)
    except FileNotFoundError:
        return False
    except ValueError:
        pass
    return True


def looks_local(spec: str) -> bool:
    # A path, not a hub id: it starts with ./, ../, / or ~, or its first folder exists here (runs/nope:
    # runs/ is a folder). A typo there must say "not found", not try a download that fails as "Offline?".
    # A name that ends as a data file does (dta/train.jsonl) is a file too. An owner/name with no folder
    # `owner` here stays a hub id.
    parts = Path(spec).parts
    return (spec.startswith((".", "/", "~")) or len(parts) > 1 and Path(parts[0]).is_dir()
            or Path(spec).suffix.lower() in DATA_SUFFIXES)


def nearby(path: Path) -> str:
    # What the deepest existing folder above `path` says about a typo: " (runs/x does not exist)", or
    # " (did you mean runs/quickstart?)" where its folder holds a name close to the one asked for.
    import difflib

    parent = path.parent
    if not parent.is_dir():
        return f" ({parent} does not exist)"
    close = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir() if p.is_dir()], n=1)
    return f" (did you mean {parent / close[0]}?)" if close else ""
