"""Peak summed RSS and PSS (MiB) of a process tree (a server and its workers), sampled every 0.25 s
until SIGTERM/SIGINT, then written to a file: `python loadtest/tree_rss.py PID OUT`."""
import os, signal, sys, time
root = int(sys.argv[1]); out = sys.argv[2]
peak_rss = peak_pss = 0
def tree():
    kids = {}
    for d in os.listdir('/proc'):
        if d.isdigit():
            try:
                st = open(f'/proc/{d}/stat').read(); ppid = int(st.rsplit(')', 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except OSError: pass
    todo, seen = [root], []
    while todo:
        p = todo.pop(); seen.append(p); todo += kids.get(p, [])
    return seen
def val(p, f, key):
    try:
        for line in open(f'/proc/{p}/{f}'):
            if line.startswith(key): return int(line.split()[1])
    except OSError: pass
    return 0
def stop(*_):
    open(out, 'w').write(f"peak_rss_mib={peak_rss/1024:.0f} peak_pss_mib={peak_pss/1024:.0f}\n"); sys.exit(0)
signal.signal(signal.SIGTERM, stop); signal.signal(signal.SIGINT, stop)
while True:
    ps = tree()
    peak_rss = max(peak_rss, sum(val(p, 'status', 'VmRSS:') for p in ps))
    peak_pss = max(peak_pss, sum(val(p, 'smaps_rollup', 'Pss:') for p in ps))
    time.sleep(0.25)
