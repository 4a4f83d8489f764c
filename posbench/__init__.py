"""posbench: how positional encodings behave past their training length."""
