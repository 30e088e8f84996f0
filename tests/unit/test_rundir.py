"""The run directory's atomic write, as the nodes of one job use it: at the same moment, on the same file."""
import multiprocessing as mp

from launch.outputs import write_text_atomic


def _write_many(path: str, text: str, n: int, errors) -> None:
    from pathlib import Path

    try:
        for _ in range(n):
            write_text_atomic(Path(path), text)
    except Exception as e:  # noqa: BLE001 - reported to the test
        errors.put(f"{type(e).__name__}: {e}")


def test_two_writers_of_one_file_both_succeed(tmp_path):
    # Two nodes write resolved.json into their shared run directory at once; with one temporary name for both, one
    # writer's os.replace took the file the other was about to move (FileNotFoundError).
    path = tmp_path / "resolved.json"
    texts = ["a" * 50_000, "b" * 50_000]
    errors = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=_write_many, args=(str(path), t, 300, errors)) for t in texts]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert errors.empty(), errors.get()
    assert path.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["resolved.json"]  # no temporary file left behind


def test_two_threads_of_one_process_write_one_file(tmp_path):
    # The watchdog thread and the main thread of a rank can record a failure at once.
    import threading

    path = tmp_path / "failure_rank0.json"
    errors = []

    def write(text):
        try:
            for _ in range(300):
                write_text_atomic(path, text)
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=write, args=(c * 20_000,)) for c in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and path.read_text() in ("a" * 20_000, "b" * 20_000)
    assert [p.name for p in tmp_path.iterdir()] == ["failure_rank0.json"]
