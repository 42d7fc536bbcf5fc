"""A misbehaving MCP stdio server, spoken by hand (JSON-RPC lines), for Warden's tests of bad
input. Tools:

- `ok`: answers "fine" (the host keeps serving after the others).
- `crash`: the process exits with status 3 mid-call (after a line on stderr).
- `hang`: never answers.
- `garbage`: answers with a line that is not JSON-RPC.
- `odd_schema`: listed with an input schema that is not JSON Schema.
- `fail`: a tool error (`isError: true`).

Every call is appended to $CALLS_FILE (when set) before anything else, so tests can tell
whether a call reached the server at all.
"""

import json
import os
import sys

OBJ = {"type": "object"}
TOOLS = [
    {"name": "ok", "inputSchema": OBJ, "annotations": {"readOnlyHint": True}},
    {"name": "crash", "inputSchema": OBJ},
    {"name": "hang", "inputSchema": OBJ},
    {"name": "garbage", "inputSchema": OBJ},
    {"name": "odd_schema", "inputSchema": {"type": "object", "properties": {"x": 5}}},
    {"name": "fail", "inputSchema": OBJ},
]


def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def result(id_, value):
    send({"jsonrpc": "2.0", "id": id_, "result": value})


def text(s):
    return {"content": [{"type": "text", "text": s}]}


for line in sys.stdin:
    if not line.strip():
        continue
    msg = json.loads(line)
    method, id_ = msg.get("method"), msg.get("id")
    if id_ is None:
        continue  # notifications
    if method == "initialize":
        version = msg.get("params", {}).get("protocolVersion", "2025-06-18")
        result(id_, {"protocolVersion": version, "capabilities": {"tools": {}},
                     "serverInfo": {"name": "bad-server", "version": "1"}})
    elif method == "ping":
        result(id_, {})
    elif method == "tools/list":
        result(id_, {"tools": TOOLS})
    elif method == "tools/call":
        name = msg["params"]["name"]
        if os.environ.get("CALLS_FILE"):
            with open(os.environ["CALLS_FILE"], "a", encoding="utf-8") as f:
                f.write(name + "\n")
        if name == "ok":
            result(id_, text("fine"))
        elif name == "crash":
            sys.stderr.write("bad-server: boom, crashing on purpose\n")
            sys.stderr.flush()
            os._exit(3)
        elif name == "hang":
            pass
        elif name == "garbage":
            sys.stdout.write("this is not JSON-RPC\n")
            sys.stdout.flush()
        elif name == "fail":
            result(id_, dict(text("it did not work"), isError=True))
        else:
            send({"jsonrpc": "2.0", "id": id_, "error": {"code": -32602, "message": f"unknown tool {name}"}})
    else:
        send({"jsonrpc": "2.0", "id": id_, "error": {"code": -32601, "message": f"no method {method}"}})
