#!/bin/bash
sort -u /app/words.txt | wc -l > /app/count.txt
