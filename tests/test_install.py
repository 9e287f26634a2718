"""The package as installed: the src layout keeps ``import hhook`` the package even from
the folder that holds a clone named ``hhook`` (issue 61 item 7: with the package at the
repository's top, that clone was imported as an empty namespace package)."""
import subprocess
import sys


def test_import_from_the_folder_holding_a_clone_named_hhook_is_the_package(tmp_path):
    (tmp_path / "hhook" / "tests").mkdir(parents=True)  # what `git clone` leaves: no __init__.py at its top
    (tmp_path / "hhook" / "README.md").write_text("a clone\n")
    out = subprocess.run([sys.executable, "-c", "import hhook; print(hhook.register.__module__)"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("hhook")
