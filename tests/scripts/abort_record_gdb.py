"""gdb script for tests/test_abort_record.py: run as

    gdb -batch -nx -x tests/scripts/abort_record_gdb.py --args abort_record REASON

It stops the program at the entry of shm_abort (csrc/shm.c), finds the segment's abort record
(`aborted`, the published status, and `reason`), then executes shm_abort one instruction at a
time (stepping over calls) until it returns.  After every instruction it reads the record as a
peer would: whenever `aborted` is non-zero, `reason` must already hold the whole REASON.  A
peer on another core can look at the record between any two of these instructions, so this
checks every interleaving the writer's program order allows.  Prints one JSON line:
{"steps", "published_at", "violations": [[step, reason seen]], "final_reason"}.
"""

import json

import gdb



def u32(address):
    return int.from_bytes(gdb.selected_inferior().read_memory(address, 4).tobytes(), "little")


def text(address, size):
    raw = gdb.selected_inferior().read_memory(address, size).tobytes()
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def main():
    gdb.execute("set pagination off")
    gdb.execute("set confirm off")
    gdb.execute("break shm_abort")
    gdb.execute("run", to_string=True)
    reason_arg = gdb.parse_and_eval("reason").string()
    header = gdb.parse_and_eval("((shm_transport *)t)->header")
    aborted_at = int(header["aborted"].address)
    reason_at = int(header["reason"].address)
    size = int(header["reason"].type.sizeof)
    return_address = int(gdb.parse_and_eval("*(unsigned long *)$sp"))
    steps, published_at, violations = 0, None, []
    while int(gdb.parse_and_eval("$pc")) != return_address and steps < 20000:
        gdb.execute("nexti", to_string=True)
        steps += 1
        if u32(aborted_at) != 0:
            if published_at is None:
                published_at = steps
            seen = text(reason_at, size)
            if seen != reason_arg:
                violations.append([steps, seen])
    print(json.dumps({"steps": steps, "published_at": published_at, "violations": violations[:5],
                      "final_reason": text(reason_at, size), "expected": reason_arg}))
    gdb.execute("kill")


main()
