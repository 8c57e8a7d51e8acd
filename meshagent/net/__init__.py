"""The overlay's trio side: transports (TCP, simulated), connections, listener, manager.

Code here only moves bytes and events between sockets and the sans-IO state machines in
`meshagent.wire`. See docs/protocol.md for the protocol itself.
"""
