"""The local spool: every fsync'd line is replayed, even while writers keep appending."""

from __future__ import annotations

import threading

from metering import spool


def test_replay_racing_writers_delivers_every_line(tmp_path):
    # given two writer threads appending while a replayer claims files over and over
    directory = tmp_path / "spool"
    writer = spool.SpoolWriter(directory)
    written: list[bytes] = []
    delivered: list[bytes] = []
    lock = threading.Lock()
    done = threading.Event()

    failures: list[BaseException] = []

    def write(prefix: str) -> None:
        for i in range(400):
            line = f'["{prefix}-{i}"]'.encode()
            try:
                writer.append(line)
            except OSError as exc:
                failures.append(exc)
                continue
            with lock:
                written.append(line)

    writers = [threading.Thread(target=write, args=(p,)) for p in ("a", "b")]
    for t in writers:
        t.start()

    def replay_loop() -> None:
        while not done.is_set():
            spool.replay(directory, delivered.extend)

    replayer = threading.Thread(target=replay_loop)
    replayer.start()
    for t in writers:
        t.join()
    done.set()
    replayer.join()

    # when a last replay runs
    spool.replay(directory, delivered.extend)

    # then no append failed, every line was delivered exactly once (nothing lost, nothing
    # replayed twice) and no file is left behind
    assert not failures
    assert len(written) == 800
    assert sorted(delivered) == sorted(written)
    assert not list(directory.iterdir())


def test_a_torn_last_line_is_skipped_and_the_rest_replayed(tmp_path):
    directory = tmp_path / "spool"
    directory.mkdir()
    (directory / "usage-host-1.spool").write_bytes(b'["one"]\n["two"]\n["thr')
    delivered: list[bytes] = []

    report = spool.replay(directory, delivered.extend)

    assert delivered == [b'["one"]', b'["two"]']
    assert report.unreadable == ['["thr']
    assert report.files == 1


def test_a_failing_sink_keeps_the_file_for_the_next_pass(tmp_path):
    directory = tmp_path / "spool"
    spool.SpoolWriter(directory).append(b'["kept"]')

    def down(lines: list[bytes]) -> None:
        raise ConnectionError("PostgreSQL and Redis are down")

    first = spool.replay(directory, down)
    delivered: list[bytes] = []
    second = spool.replay(directory, delivered.extend)

    assert first.left == 1 and first.files == 0
    assert delivered == [b'["kept"]'] and second.files == 1
