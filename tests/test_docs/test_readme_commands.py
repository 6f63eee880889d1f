"""The README and docs cannot silently rot: their commands, paths and links exist and parse.

Every shell command in a ``bash`` block of README.md and docs/*.md that runs
a tool of this repository is checked: the tool exists, and each Python tool
answers ``--help`` (slow: one interpreter per tool). Every repository path a
command or a relative link names exists; every ``make`` target is defined.
"""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md')) + sorted(
    (ROOT / 'configs').glob('**/README.md'))
PLACEHOLDERS = {'CHECKPOINT', 'CONFIG', 'DIR', 'FILE', 'N'}


def _bash_lines(path: Path):
    """Logical lines (continuations joined) of the ``bash`` blocks of a markdown file."""
    text = path.read_text()
    for block in re.findall(r'```bash\n(.*?)```', text, flags=re.S):
        for line in block.replace('\\\n', ' ').splitlines():
            line = line.split(' #')[0].strip()
            if line and not line.startswith('#'):
                yield line


def _commands():
    for path in DOCS:
        for line in _bash_lines(path):
            yield path.relative_to(ROOT).as_posix(), line


COMMANDS = list(_commands())


def _repo_paths(words):
    """Words that name files of this repository (tools, configs, docs)."""
    for w in words:
        w = w.split('=', 1)[-1]
        if re.match(r'^(tools|configs|docs|kcla_mm)/[\w./-]+$', w) and '*' not in w \
                and '?' not in w and '[' not in w:
            yield w


def test_the_readme_has_commands_to_check():
    readme = [line for doc, line in COMMANDS if doc == 'README.md']
    assert any(line.startswith('make demo') for line in readme)
    assert any('tools/train.py' in line for line in readme)


@pytest.mark.parametrize('doc,line', COMMANDS)
def test_every_path_a_command_names_exists(doc, line):
    try:
        words = shlex.split(line)
    except ValueError as e:
        pytest.fail(f'{doc}: cannot parse {line!r}: {e}')
    for w in _repo_paths(words):
        # an output the command writes is not expected to exist
        if Path(w).suffix in ('.pth', '.onnx', '.json', '.pkl') or w.startswith('work_dirs'):
            continue
        assert (ROOT / w).exists(), f'{doc}: {line!r} names {w}, which does not exist'


def test_every_make_target_is_defined():
    targets = set(re.findall(r'^([\w-]+):', (ROOT / 'Makefile').read_text(), flags=re.M))
    for doc, line in COMMANDS:
        words = shlex.split(line)
        for i, w in enumerate(words):
            if w == 'make' or w.endswith('/make'):
                target = next((t for t in words[i + 1:] if not t.startswith('-')
                               and '=' not in t), None)
                assert target in targets, f'{doc}: make target {target!r} is not in the Makefile'


def test_every_relative_link_exists():
    for path in DOCS:
        for target in re.findall(r'\]\(([^)#\s]+)(?:#[^)]*)?\)', path.read_text()):
            if re.match(r'^[a-z]+://', target) or target.startswith('mailto:'):
                continue
            assert (path.parent / target).exists(), f'{path.relative_to(ROOT)}: link {target}'


def _python_tools():
    tools = set()
    for _, line in COMMANDS:
        words = shlex.split(line)
        for i, w in enumerate(words):
            if w.startswith('tools/') and w.endswith('.py') and i > 0 \
                    and 'python' in words[i - 1]:
                tools.add(w)
    return sorted(tools)


@pytest.mark.slow
@pytest.mark.parametrize('tool', _python_tools())
def test_every_python_tool_answers_help(tool):
    res = subprocess.run([sys.executable, str(ROOT / tool), '--help'], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f'{tool} --help failed:\n{res.stderr[-2000:]}'
    assert 'usage' in res.stdout.lower()
