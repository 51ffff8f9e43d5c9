#!/bin/bash
set -e
wc -w < /app/notes.txt | tr -d ' ' > /app/count.txt
