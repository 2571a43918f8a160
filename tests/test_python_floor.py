"""The oldest Python pyproject.toml accepts (requires-python) runs the product: every module
compiles there, and the few standard-library calls that differ across versions work (a
3.11-only `Task.cancelling()` once broke HTTP disconnects on 3.10). Uses a `python3.X` of that
version on this machine (PATH or pyenv); skipped, saying so, where there is none."""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOOR = re.search(r'requires-python\s*=\s*">=(\d+\.\d+)"', (REPO / "pyproject.toml").read_text()).group(1)
# The product: the package pdserve/ (its subpackages are the folders the top-level links name);
# tests and bench run on CI's Python.
PRODUCT = [REPO / "pdserve"]


def _floor_python() -> str | None:
    candidates = [str(p) for p in sorted(Path.home().glob(f".pyenv/versions/{FLOOR}.*/bin/python"))]
    candidates += [found for found in [shutil.which(f"python{FLOOR}")] if found]  # a pyenv shim may not run
    for exe in candidates:
        try:
            out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == FLOOR:
            return exe
    return None


PY = _floor_python()
pytestmark = pytest.mark.skipif(PY is None, reason=f"no Python {FLOOR} here (python{FLOOR} or pyenv)")


def test_every_product_module_compiles_on_the_oldest_supported_python(tmp_path):
    files = [str(f) for folder in PRODUCT for f in folder.rglob("*.py") if "bench" not in f.relative_to(folder).parts]
    assert len(files) > 100
    script = ("import sys\nbad = []\nfor f in sys.argv[1:]:\n    try:\n"
              "        compile(open(f, encoding='utf-8').read(), f, 'exec')\n"
              "    except SyntaxError as e:\n        bad.append(f'{f}:{e.lineno}: {e.msg}')\nprint('\\n'.join(bad))\n"
              "sys.exit(1 if bad else 0)\n")
    out = subprocess.run([PY, "-c", script, *files], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_a_client_disconnect_is_taken_back_on_the_oldest_supported_python():
    """api/disconnect.py's ClientWatch on Python FLOOR: the disconnect cancels the handler, the
    handler asks gone() and returns normally (imports only asyncio: loaded by path)."""
    script = textwrap.dedent(f"""\
        import asyncio, importlib.util
        spec = importlib.util.spec_from_file_location("disconnect", {str(REPO / "api" / "disconnect.py")!r})
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)

        async def main():
            left = asyncio.Event()
            async def receive():
                await left.wait()
                return {{"type": "http.disconnect"}}
            async def handler():
                watch = mod.ClientWatch(receive)
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    assert watch.gone()
                    return "gone"
                finally:
                    watch.close()
            task = asyncio.ensure_future(handler())
            await asyncio.sleep(0)
            left.set()
            print(await asyncio.wait_for(task, 10))
        asyncio.run(main())
        """)
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "gone", out.stdout + out.stderr
