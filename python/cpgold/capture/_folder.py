"""The capture folder: which files a capture writes, and how it writes them without replacing anything.

Layout (docs/capture.md, "Files"):

    FOLDER/.cpgold-capture            marker: this folder is a capture folder (written once, never replaced)
    FOLDER/index.rank<G>.jsonl        one JSON line per call seen by global rank G (captured, unsupported, skipped, ...)
    FOLDER/calls/<call>/rank<G>.h5    the rank-local tensors and the layout of one call on rank G
    FOLDER/joined/<call>/             after `join`: case.json, inputs.h5, candidate.h5, join.json (written last);
                                      golden.h5 after `check --keep-golden`; shrunk/ after `shrink`
    .<name>.partial-<pid>-<thread>    a file being written (renamed into place without replacing, or removed)

A folder holding anything else (another file, a link, a folder of another name) is refused before anything is
written to it, so a capture never mixes with, or overwrites, files it did not write.
"""
import json
import os
import re
import threading

from ..errors import InputError

MARKER = ".cpgold-capture"
MARKER_CONTENT = {"format": "cpgold-capture", "version": 1}
FORMAT_VERSION = 1

_PARTIAL = re.compile(r"^\..+\.partial-\d+-\d+$")
_ROOT_FILES = (re.compile(r"^index\.rank\d+\.jsonl$"),)
_CALL_FILES = (re.compile(r"^rank\d+\.h5$"),)
_JOINED_FILES = {"case.json", "inputs.h5", "candidate.h5", "join.json", "golden.h5"}
_SHRUNK_FILES = {"case.json", "inputs.h5", "shrink.json"}
_NAME = re.compile(r"^[A-Za-z0-9_.~@+-]+$")


class CaptureFolderError(InputError):
    """A folder that is not a capture folder, or holds files a capture did not write (field: the path)."""


def _is_partial(name):
    return bool(_PARTIAL.match(name))


def _entries(path):
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        return []


def _regular(entry):
    return entry.is_file(follow_symlinks=False)


def _folder(entry):
    return entry.is_dir(follow_symlinks=False)


def foreign_entries(folder):
    """Paths (relative to folder) of everything a capture would not have written, sorted; [] for a capture folder
    (or an empty one). Links of any kind are foreign: a capture never makes one."""
    out = []
    for e in _entries(folder):
        name = e.name
        if name == MARKER or _is_partial(name) or any(p.match(name) for p in _ROOT_FILES):
            if not _regular(e):
                out.append(name)
            continue
        if name in ("calls", "joined") and _folder(e):
            for call in _entries(e.path):
                rel = f"{name}/{call.name}"
                if _is_partial(call.name) and name == "joined" and _folder(call):
                    continue
                if not _folder(call) or not _NAME.match(call.name):
                    out.append(rel)
                    continue
                for f in _entries(call.path):
                    frel = f"{rel}/{f.name}"
                    if name == "calls":
                        ok = _regular(f) and (_is_partial(f.name) or any(p.match(f.name) for p in _CALL_FILES))
                    elif f.name == "shrunk" and _folder(f):
                        ok = True
                        for g in _entries(f.path):
                            if not (_regular(g) and (g.name in _SHRUNK_FILES or _is_partial(g.name))):
                                out.append(f"{frel}/{g.name}")
                    else:
                        ok = _regular(f) and (f.name in _JOINED_FILES or _is_partial(f.name))
                    if not ok:
                        out.append(frel)
            continue
        out.append(name)
    return out


def is_capture_folder(folder):
    return os.path.isfile(os.path.join(folder, MARKER)) and not os.path.islink(os.path.join(folder, MARKER))


def require_capture_folder(folder, what="folder"):
    """InputError unless `folder` is a capture folder holding only files a capture writes."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CaptureFolderError(f"{what}: {folder!r} is not a folder", folder)
    if not is_capture_folder(folder):
        raise CaptureFolderError(f"{what}: {folder!r} is not a capture folder (no {MARKER} file: "
                                 "cpgold.capture.Capture(folder) makes one)", folder)
    _read_marker(folder)
    foreign = foreign_entries(folder)
    if foreign:
        raise CaptureFolderError(_foreign_message(folder, foreign), os.path.join(folder, foreign[0]))
    return folder


def _foreign_message(folder, foreign):
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return (f"capture folder {folder!r} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} not written "
            f"by a capture ({shown}): a capture writes only into a new folder, an empty one or its own; choose "
            "another folder")


def _read_marker(folder):
    path = os.path.join(folder, MARKER)
    try:
        with open(path, "rb") as f:
            text = f.read(4096)
        content = json.loads(text.decode("utf-8"))
    except (OSError, ValueError) as e:
        raise CaptureFolderError(f"{path}: not a capture marker ({type(e).__name__}: {e})", path) from None
    if not isinstance(content, dict) or content.get("format") != MARKER_CONTENT["format"]:
        raise CaptureFolderError(f"{path}: not a capture marker (content {text[:80]!r})", path)
    if content.get("version") != FORMAT_VERSION:
        raise CaptureFolderError(f"{path}: capture format version {content.get('version')!r}, this cpgold reads "
                                 f"version {FORMAT_VERSION}", path)
    return content


def open_for_capture(folder):
    """Makes `folder` a capture folder (created with its parents if missing) or accepts an existing one; InputError
    for a folder that holds anything a capture does not write, or a path that is not a folder."""
    folder = os.fspath(folder)
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise CaptureFolderError(f"folder: {folder!r} exists and is not a folder", folder)
    if os.path.islink(folder):
        raise CaptureFolderError(f"folder: {folder!r} is a symbolic link: give the folder itself", folder)
    os.makedirs(folder, exist_ok=True)
    foreign = foreign_entries(folder)
    if foreign:
        raise CaptureFolderError(_foreign_message(folder, foreign), os.path.join(folder, foreign[0]))
    if not is_capture_folder(folder):
        # Without the marker only files being written may be there (another rank's process making the marker now).
        names = [e.name for e in _entries(folder) if not _is_partial(e.name)]
        if names:
            raise CaptureFolderError(f"folder: {folder!r} holds {', '.join(names[:5])} but no {MARKER} marker: not "
                                     "a capture folder", folder)
        text = (json.dumps(MARKER_CONTENT) + "\n").encode()
        try:
            write_new_bytes(os.path.join(folder, MARKER), text)
        except FileExistsError:
            pass  # another rank's process made it at the same moment
    _read_marker(folder)
    return folder


def _partial_name(path):
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.partial-{os.getpid()}-{threading.get_ident()}")


def write_new(path, fill):
    """Writes a new file at `path`: fill(temporary_path) writes it under a hidden temporary name in the same folder,
    which is then linked to `path` (never replacing: FileExistsError when `path` exists) and removed. Nothing is left
    behind when fill or the link fails."""
    temporary = _partial_name(path)
    try:
        fill(temporary)
        try:
            os.link(temporary, path)
        except FileExistsError:
            raise
        except OSError:
            # A file system without hard links: claim the name exclusively, then move the file over the claim
            # (which is this call's own empty file, so nothing of anyone else's is replaced).
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)


def write_new_bytes(path, data):
    def fill(tmp):
        with open(tmp, "xb") as f:
            f.write(data)
    write_new(path, fill)


def write_new_json(path, obj):
    write_new_bytes(path, (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode())


def write_case(folder, case, inputs):
    """case.json (the case) and inputs.h5 (q, k, v, dout of `inputs`) in `folder`, each new: what a joined call and
    its shrunk case hold for `cpgold gen --case ... --inputs ...`."""
    import h5py

    write_new_bytes(os.path.join(folder, "case.json"), (json.dumps(case) + "\n").encode())

    def fill(tmp):
        with h5py.File(tmp, "x") as f:
            for name in ("q", "k", "v", "dout"):
                f.create_dataset(name, data=inputs[name])
    write_new(os.path.join(folder, "inputs.h5"), fill)


def safe_name(text):
    """A file-name-safe form of a layer name (letters, digits, '_', '.', '-'; anything else becomes '_')."""
    out = re.sub(r"[^A-Za-z0-9_.-]", "_", str(text))
    out = out.strip(".") or "_"
    return out[:120]
