"""Build hook (the project's metadata is in pyproject.toml): ship the dispatch tables of
tuned/ (the user's layout) inside the package as resgen/_tuned/, so that a wheel or a
non-editable install serves them (resgen.settings.default_tuned_dir). An editable install
reads tuned/ in place and copies nothing."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithTables(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        src = Path(__file__).resolve().parent / "tuned"
        dest = Path(self.build_lib) / "resgen" / "_tuned"
        for table in sorted(src.glob("*.sqlite")) + sorted(src.glob("*.sqlite.xz")):
            dest.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(table), str(dest / table.name))


setup(cmdclass={"build_py": BuildPyWithTables})
