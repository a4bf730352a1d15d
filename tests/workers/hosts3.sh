#!/bin/sh
# Three "hosts" that all resolve to this machine, one slot each (horovodrun elastic discovery).
echo localhost:1
echo 127.0.0.1:1
echo "$(hostname -I | cut -d' ' -f1):1"
