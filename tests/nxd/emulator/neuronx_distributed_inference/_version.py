# The release whose contract the emulator follows (SDK 2.29): no chunked prefill (removed in 0.8).
__version__ = "0.9.0"
