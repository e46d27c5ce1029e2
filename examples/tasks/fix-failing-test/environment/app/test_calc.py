from calc import add, mul

assert add(2, 3) == 5, add(2, 3)
assert mul(2, 3) == 6, mul(2, 3)
print("ok")
