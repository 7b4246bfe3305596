#!/usr/bin/env python3
"""Embeds a PTX file as a NUL-terminated C byte array: embed.py in.ptx out.c symbol.
(A byte array, not a string literal: ISO C limits literals to 4095 bytes.)"""
import sys
src, dst, sym = sys.argv[1], sys.argv[2], sys.argv[3]
data = open(src, 'rb').read() + b'\0'
with open(dst, 'w') as f:
    f.write('/* generated from %s */\n' % src.split('/')[-1])
    f.write('const char %s[] = {\n' % sym)
    for i in range(0, len(data), 16):
        f.write('\t' + ', '.join('0x%02x' % b for b in data[i:i + 16]) + ',\n')
    f.write('};\n')
