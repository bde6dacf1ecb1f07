# nodes: 4 edges: 3 directed: no
0 1
1 2
3 0
