"""What can go wrong in net-sim, each with a message that says what to do."""


class NetSimError(Exception):
    """Root of net-sim's errors."""


class NeedsRoot(NetSimError):
    """net-sim was started without root, or without `ip` or /dev/net/tun."""


class EmulatorError(NetSimError):
    """The link emulator refused a command, failed to start, or died."""
