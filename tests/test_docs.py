"""The code blocks of README.md and docs/*.md run, on small data, so the docs cannot drift from the code.

Convention (for whoever edits the docs):

* every ```python, ```bash, ```sh and ```console block is executed, unless the line right
  before its opening fence is ``<!-- not run: REASON -->`` (a reason is required);
* what a command prints goes in a ```text block (never executed); every fence names its language.
  A ```text block right after a block that runs (nothing but blank lines between) is that
  block's output, and is checked against what it really printed, normalised (``normalise``:
  every number and hex digest stands for any, the working folder is shown as ``/tmp/example``, runs of spaces for
  one, and a line ``...`` for any lines), so the docs cannot go stale silently; a ```text block
  with prose before it (what a run on other data or another machine printed) is not checked;
* the blocks of one file run in order, in one fresh temporary working directory: the python
  blocks in one shared namespace, the shell blocks with ``bash -e`` (a ```console block: its
  ``$ `` lines only). So each file makes its own data first (``images/`` from
  ``dlstore.sources.demo.make_image_folder``) and later blocks use what earlier ones wrote;
* a command expected to fail is written ``cmd || echo "exit code $?"``, a Python call expected to
  raise inside ``try``/``except``: that is what a reader can paste, and it documents the exit code;
* the environment is that of a one-process ``torchrun`` (RANK=0, WORLD_SIZE=1, MASTER_ADDR/PORT)
  and ``sys.argv`` holds no arguments, so a training script written for torchrun runs as is.

Starting Python and importing torch takes seconds (tens of seconds on a loaded 2-core machine),
so ``dlstore`` in the shell blocks is a small client on PATH that asks a server process (started
once per test session, dlstore imported once) to fork and run ``dlstore.cli.main`` with the
command's arguments, working directory, environment and file descriptors: the code of the console
script, without a fresh interpreter per command. ``DLSTORE_DOCS_REAL_CLI=1`` (and any platform
but Linux) runs the installed console script instead.

The README runs in the fast loop (``-m "not slow"``), the other files in the full one. Run one file:
``pytest tests/test_docs.py -k reading -s`` (``-s`` shows what every block printed,
to paste into the docs' ```text blocks).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)```(.*)$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:(.*?)-->\s*$")
SHELL_TIMEOUT = 300


@dataclass
class Block:
    path: Path
    line: int             # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None   # the reason, when the block is marked not run
    end: int = 0          # 1-based line of the closing fence
    output: Block | None = None   # the ```text block right after it: what it prints

    @property
    def run(self) -> bool:
        return self.not_run is None and self.lang in PYTHON | SHELL

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with its language and not-run reason."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.group(1), opening.group(2).strip()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path.name}:{i + 1}: code fence never closed")
        code = textwrap.dedent("\n".join(line.removeprefix(indent) for line in lines[i + 1:end]))
        marker = NOT_RUN.match(lines[i - 1]) if i > 0 else None
        blocks.append(Block(path, i + 1, lang, code + "\n", marker.group(1).strip() if marker else None, end + 1))
        i = end + 1
    for block, after in zip(blocks, blocks[1:]):
        if after.lang == "text" and all(not line.strip() for line in lines[block.end:after.line - 1]):
            block.output = after
    return blocks


_PROGRESS = re.compile(r"\d+%\|.*\|")   # a tqdm progress bar (stderr, merged into the shell blocks' output)
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,_]*(\.\d+)?(e[-+]?\d+)?", re.IGNORECASE)
# a number's unit of time or size may change with it (0.9 ms, 950 us)
_UNIT = re.compile(r"\bN ?(ns|us|µs|ms|s|min|h|B|KiB|MiB|GiB|TiB|kB|MB|GB|TB)\b")
_HEX = re.compile(r"\b(0x[0-9a-f]+|[0-9a-f]{16,})\b", re.IGNORECASE)


# The working folder as the docs show it (an absolute path the reader can picture)
DOCS_FOLDER = "/tmp/example"


def normalise(text: str, work: Path) -> list[str]:
    """The lines of ``text`` as compared: the working folder's path (as DOCS_FOLDER), hex digests and numbers
    stand for any (with their units of time or size), runs of spaces for one; blank lines, trailing
    spaces and progress bars do not count."""
    lines = []
    for line in text.replace(str(work), DOCS_FOLDER).splitlines():
        if _PROGRESS.search(line):
            continue
        line = _UNIT.sub("N <unit>", _NUMBER.sub("N", _HEX.sub("H", line)))
        line = re.sub(r"\s+", " ", line).strip()
        if line:
            lines.append(line)
    return lines


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` matches ``expected``, where an expected line ``...`` stands for any lines."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(matches(expected[1:], actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


# --------------------------------------------------------------------------- the dlstore command

# The `dlstore` the shell blocks find on PATH: hands its arguments, working directory,
# environment and stdin/stdout/stderr to the server, and exits with the command's exit code.
CLIENT = """\
import json, os, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.connect(os.environ["DLSTORE_DOCS_SOCKET"])
request = json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
socket.send_fds(sock, [request], [0, 1, 2])
reply = sock.recv(64)
sys.exit(int(reply) if reply else 70)
"""

# The server, a process of its own: it imports dlstore once and never runs a torch op, so a
# child forked from it starts as a fresh `dlstore` process would (a process that has run
# OpenMP work, like this test process, cannot fork safely: the child hangs in libgomp).
SERVER = r"""
import json, os, socket, sys, traceback
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(8)
import torchvision.transforms.v2.functional  # paid here once, not by every command
import dlstore.cli

def run(request, fds):
    code = 70
    try:
        listener.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["dlstore", *request["argv"]]
        try:
            dlstore.cli.main.main(args=request["argv"], prog_name="dlstore")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)

while True:
    conn, _ = listener.accept()
    with conn:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if not message:
            continue
        pid = os.fork()
        if pid == 0:
            conn.close()
            run(json.loads(message), fds)
        for fd in fds:
            os.close(fd)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        conn.send(str(code if code >= 0 else 128 - code).encode())
"""


class CliServer:
    """The server process behind the shell blocks' ``dlstore`` (see the module docstring)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.bindir = folder / "bin"
        self.bindir.mkdir()
        # AF_UNIX paths are limited to ~100 bytes: the socket goes to a short folder of its own.
        self.socket = Path(tempfile.mkdtemp(prefix="dlstore-docs-")) / "cli.sock"
        self.log = folder / "server.log"
        self.proc: subprocess.Popen | None = None
        if os.environ.get("DLSTORE_DOCS_REAL_CLI") or sys.platform != "linux":  # the server is Linux-only
            (self.bindir / "dlstore").symlink_to(Path(sys.executable).parent / "dlstore")
        else:
            (self.bindir / "dlstore").write_text(f"#!{sys.executable} -IS\n{CLIENT}")
            (self.bindir / "dlstore").chmod(0o755)
            self.start()

    def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(self.socket)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.socket.exists():   # bound before the imports: commands wait in its backlog
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the dlstore command server did not start:\n{self.log.read_text()}", pytrace=False)
            time.sleep(0.01)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)   # its session: the server and any command still running
            self.proc.wait()
        shutil.rmtree(self.socket.parent, ignore_errors=True)

    def run(self, block: Block, cwd: Path) -> str:
        """Run a shell block with ``bash -e`` in ``cwd``; return what it printed."""
        code = block.code
        if block.lang == "console":
            code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ ")) + "\n"
        if self.proc is not None and self.proc.poll() is not None:
            self.start()
        env = dict(os.environ, PATH=f"{self.bindir}{os.pathsep}{os.environ['PATH']}",
                   DLSTORE_DOCS_SOCKET=str(self.socket))
        try:
            done = subprocess.run(["bash", "-e", "-c", code], check=False, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=SHELL_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            self.stop()
            output = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output or ""
            pytest.fail(f"{block.where}: still running after {SHELL_TIMEOUT} s:\n{block.code}\n--- output ---\n"
                        f"{output}", pytrace=False)
        if done.returncode != 0:
            server = f"\n--- server log ---\n{self.log.read_text()}" if self.log.exists() else ""
            pytest.fail(f"{block.where}: the {block.lang} block exited with {done.returncode}:\n{block.code}\n"
                        f"--- output ---\n{done.stdout}{server}", pytrace=False)
        return done.stdout


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    server = CliServer(tmp_path_factory.mktemp("cli"))
    # The python blocks need torchvision's transforms: import them here while the server
    # imports its own, so the two imports overlap instead of adding up.
    import torchvision.transforms.v2  # noqa: F401
    yield server
    server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- tests

@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_blocks_are_marked(doc):
    """Every fence names its language; a not-run block says why; only code runs, text never."""
    problems = [f"{doc.name}:{n}: write <!-- not run: REASON --> on the line right before the fence"
                for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
                if line.lstrip().startswith("<!--") and "not run" in line and not NOT_RUN.match(line)]
    for block in parse_blocks(doc):
        if not block.lang:
            problems.append(f"{block.where}: fence without a language (```text for output, ```bash, ```python)")
        if block.not_run is not None and not block.not_run:
            problems.append(f"{block.where}: <!-- not run: --> without a reason")
        if block.not_run and block.lang not in PYTHON | SHELL:
            problems.append(f"{block.where}: a {block.lang} block is never run; drop the not-run marker")
    assert not problems, "\n".join(problems)


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    anchors, in_code = set(), False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc):
    """Relative links point at files that exist, and anchors at headings that exist."""
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.DOTALL)
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            problems.append(f"{doc.name}: link to {target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            problems.append(f"{doc.name}: link to {target}: no such heading")
    assert not problems, "\n".join(problems)


def _runnable(doc: Path) -> bool:
    return any(block.run for block in parse_blocks(doc))


@pytest.mark.parametrize("doc", [pytest.param(d, marks=() if d.name == "README.md" else pytest.mark.slow)
                                 for d in DOCS if _runnable(d)], ids=lambda p: p.name)
def test_examples_run(doc, tmp_path, monkeypatch, cli):
    """Run the file's blocks in order in a fresh working directory (see the module docstring)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                        "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [str(doc)])   # as `python script.py` without arguments
    namespace: dict = {"__name__": "__main__"}
    ran = 0
    stale: list[str] = []
    for block in parse_blocks(doc):
        if not block.run:
            continue
        print(f"--- {block.where} ({block.lang})", flush=True)
        start = time.perf_counter()
        if block.lang in PYTHON:
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102 - the docs' own code
            except Exception:  # noqa: BLE001 - any error of a docs block fails the test, with its traceback
                pytest.fail(f"{block.where}: the python block raised:\n{block.code}\n"
                            f"{traceback.format_exc()}", pytrace=False)
            output = printed.getvalue()
        else:
            output = cli.run(block, work)
        print(output, end="", flush=True)
        print(f"--- {block.where}: {time.perf_counter() - start:.1f} s", flush=True)
        expected, got = (normalise(block.output.code, work), normalise(output, work)) if block.output else ([], [])
        if block.output is not None and not matches(expected, got):
            diff = "\n".join(difflib.unified_diff(expected, got, "documented", "printed", lineterm=""))
            stale.append(f"{block.where}: its output block ({block.output.where}), normalised:\n{diff}")
        ran += 1
    assert ran, f"{doc.name}: no block ran"
    assert not stale, "stale output blocks (paste what was printed, or mark elided lines with ...):\n\n" + \
        "\n\n".join(stale)
