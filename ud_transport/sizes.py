"""Byte sizes as people write them ("64K", "1M", "32768K") and back."""

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    """Bytes of "4096", "64K", "1M", "1MiB", "0.5G"; ValueError if it is none of those."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


def human(nbytes):
    """The shortest exact spelling: 1048576 -> "1M", 1000 -> "1000"."""
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
    return str(nbytes)
