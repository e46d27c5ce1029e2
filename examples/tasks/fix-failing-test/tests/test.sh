#!/bin/bash
# 1 if calc.py's add and mul are right on cases the agent has not seen, else 0
python /tests/check.py > /logs/verifier/reward.txt 2>/dev/null || echo 0 > /logs/verifier/reward.txt
