#!/bin/bash
# 1 if count.txt holds the number of distinct words of words.txt (5), else 0
if [ "$(tr -d ' \n' < /app/count.txt 2>/dev/null)" = "5" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
