"""An ordinary user's flood of reads of holes of their own partial copy (issue 51).

argv: the file, the offset of a range its copy holds, and four paths: `opened` (made
once the file is open and that range read), `go` (waited for), `ready` (made, with the
process's number, once its threads all run) and `stop`. Four processes of 300 threads
(one Python process's lock would hold back how many reads wait at once); each thread
reads 4 KiB of a random hole, another as soon as one returns (half a second after a
failure: a flood, not a spin that would take this machine's CPUs), until `stop`
appears. Each process prints how many of its reads failed.
"""
import os
import random
import sys
import threading
import time

path, held, opened, go, ready, stop = sys.argv[1:7]
fd = os.open(path, os.O_RDONLY)
os.pread(fd, 4096, int(held))
open(opened, "w").close()
while not os.path.exists(go):
    time.sleep(0.05)

me = 0
children = []
for i in range(1, 4):
    pid = os.fork()
    if pid == 0:
        me, children = i, []
        break
    children.append(pid)

failed = [0]
started = [0]
lock = threading.Lock()
grains = os.fstat(fd).st_size >> 16


def reader():
    with lock:
        started[0] += 1
    while not os.path.exists(stop):
        try:
            os.pread(fd, 4096, random.randrange(grains) << 16)
        except OSError:
            with lock:
                failed[0] += 1
            time.sleep(0.5)


threads = [threading.Thread(target=reader) for _ in range(300)]
for t in threads:
    t.start()
while started[0] < len(threads):
    time.sleep(0.05)
open(f"{ready}.{me}", "w").close()
for t in threads:
    t.join()
print(failed[0], flush=True)
for pid in children:
    os.waitpid(pid, 0)
