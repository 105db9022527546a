#!/bin/sh
# Does a second UD queue pair raise rxe's message rate? perftest's ib_send_bw -c UD with 1 and 2
# QPs, server and client on the one rxe device of the rig's guest. Run it through the rig:
#   python -m ud_transport rig run --timeout 300 -- sh scripts/rig_perftest_qps.sh
for q in 1 2 1 2; do
  timeout 60 ib_send_bw -d rxe0 -i 1 -x 1 -c UD -s 4096 -n 20000 -F -q $q > /dev/null 2>&1 &
  sleep 2
  timeout 60 ib_send_bw -d rxe0 -i 1 -x 1 -c UD -s 4096 -n 20000 -F -q $q 198.18.0.1 2>&1 | grep -E "^ 4096" | sed "s/^/qps=$q /"
  wait
done
