"""The peer wire protocol, sans-IO: handshake, encrypted records, frames, multiplexer.

Nothing here touches a socket or a clock; trio code in `meshagent.net` feeds bytes in and
sends the bytes these state machines hand back. See docs/protocol.md.
"""
