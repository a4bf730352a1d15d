#!/bin/sh
# horovodrun elastic discovery: the hosts listed in $TFDP_HOSTS_FILE (a test grows it).
cat "$TFDP_HOSTS_FILE"
