"""What a command leaves of the stop signals' handlers: the ``hpcdl`` executable discards late
stop signals until the process ends; a command run in-process (``main()`` from Python, as
tests and users' scripts do) gives the caller's handlers back, since an ignored disposition
would outlive it and pass to every child the caller starts."""
import signal

from hpcdl.train import signals


def test_in_process_the_handlers_before_come_back():
    before = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    with signals.until_exit():
        assert all(signal.getsignal(sig) is not before[sig] for sig in signals.STOP_SIGNALS)
    assert {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS} == before


def test_the_executable_discards_stop_signals_after_its_command(monkeypatch):
    before = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    monkeypatch.setattr(signals, "_process_owned", True)  # what signals.own_process() sets
    try:
        with signals.until_exit():
            pass
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in signals.STOP_SIGNALS)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
