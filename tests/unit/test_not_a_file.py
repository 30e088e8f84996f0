"""A path that is not a regular file is named as what it is, before anything opens it (a FIFO's open would wait for
a writer for ever): a FIFO, a socket, a folder, a loop of links, a link to nothing; every reader of a user's file
says it the same way (launch.inputs.not_a_file)."""
import os
import socket

import pytest

from launch.commands.cli import main
from tests.conftest import RECIPES

TINY = str(RECIPES / "tiny_zero2")


def _make(tmp_path, kind):
    p = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()
    elif kind == "folder":
        p.mkdir()
    elif kind == "loop":
        os.symlink(tmp_path / "loop2", p)
        os.symlink(p, tmp_path / "loop2")
    else:
        os.symlink(tmp_path / "nowhere", p)
    return p


SAYS = {"fifo": "is a FIFO (named pipe)", "socket": "is a socket", "folder": "is a folder",
        "loop": "is a loop of symbolic links", "dangling": "is a link to nothing"}


# a folder is an input of the corpus readers (its files); for them it is not a case here
CASES = [(kind, how) for how in ("hardware.profile", "data.path", "prepare-data") for kind in SAYS
         if not (kind == "folder" and how != "hardware.profile")]


@pytest.mark.parametrize("kind, how", CASES)
def test_what_a_path_is_is_said_in_one_line(tmp_path, capsys, kind, how):
    p = _make(tmp_path, kind)
    argv = {"prepare-data": ["prepare-data", str(p), f"out={tmp_path / 'out'}"],
            "data.path": ["run", TINY, 'data.source="text"', f"data.path={p}", "--dry-run"],
            "hardware.profile": ["run", TINY, f"hardware.profile={p}", "--dry-run"]}[how]
    if kind == "folder":  # a name ending in .json, so that it is read as a calibration file, not a profile name
        p.rename(tmp_path / "folder.json")
        argv[2] = f"hardware.profile={tmp_path / 'folder.json'}"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and SAYS[kind] in err, err
