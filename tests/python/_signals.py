"""Signal set-up for CLI subprocesses that the tests interrupt."""
import signal


def sigint_as_at_a_terminal():
    # A suite started in the background (`bash tests/run.sh &`, nohup) inherits SIGINT ignored,
    # and Python keeps an ignored SIGINT ignored: give the child the disposition Ctrl-C meets.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
