"""Peak and resident memory of load_model on a GGUF: argv = gguf, cache folder, skip|floats, label."""
import sys, time
def hwm(label):
    d = {l.split(":")[0]: l.split()[1] for l in open("/proc/self/status") if l.startswith(("VmHWM", "VmRSS"))}
    print(f"{label}: peak {int(d['VmHWM'])/1e6:.2f} GB, resident {int(d['VmRSS'])/1e6:.2f} GB", flush=True)
from pathlib import Path
from cadence.checkpoints.registry import load_model
t = time.time()
m = load_model(sys.argv[1], cache=Path(sys.argv[2]), skip_packed=sys.argv[3] == "skip")
print(f"{time.time() - t:.1f} s"); hwm(sys.argv[4])
