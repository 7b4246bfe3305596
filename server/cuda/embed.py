#!/usr/bin/env python3
"""Embeds a PTX file as a C string: embed.py in.ptx out.c symbol."""
import sys
src, dst, sym = sys.argv[1], sys.argv[2], sys.argv[3]
data = open(src, 'rb').read()
with open(dst, 'w') as f:
    f.write('/* generated from %s */\n' % src.split('/')[-1])
    f.write('const char %s[] =\n' % sym)
    for i in range(0, len(data), 64):
        chunk = data[i:i + 64].decode('ascii')
        f.write('\t"%s"\n' % chunk.replace('\\', '\\\\').replace('"', '\\"').replace('\n', '\\n').replace('\t', '\\t'))
    f.write(';\n')
