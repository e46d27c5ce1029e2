import sys

sys.path.insert(0, "/app")
from calc import add, mul  # noqa: E402

cases = [(add, 2, 3, 5), (add, -1, 1, 0), (add, 10, 0, 10), (mul, 2, 3, 6), (mul, -2, 4, -8)]
print(int(all(f(a, b) == want for f, a, b, want in cases)))
